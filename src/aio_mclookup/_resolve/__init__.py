"""Resolve: the store's answers (``answers``) to per-chunk presence (``presence``) to vLLM's
hit rules (``hits``; vLLM 0.32 / 0.33's search, on full or partly known presence, in
``era_c``; SGLang's L3 hit in ``sglang``) and the result (``result``). Imports only leaves of
the layout and plan packages."""
