"""Plan: reading hashes (``hashes``), probe targets and their cache (``targets``), what one
group probes (``probe``), key assembly (``keys``), :class:`LookupPlan` (``plan``; vLLM 0.32 /
0.33 plans in ``era_c``, SGLang's in ``sglang``), and probing in rounds (``probing``, the
0.32 / 0.33 rounds in ``probing_era_c``, which of the two a plan gets in ``rounds``)."""
