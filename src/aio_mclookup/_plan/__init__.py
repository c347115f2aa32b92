"""Plan: reading hashes (``hashes``), probe targets and their cache (``targets``), what one
group probes (``probe``), key assembly (``keys``), :class:`LookupPlan` (``plan``) and probing
in rounds (``probing``)."""
