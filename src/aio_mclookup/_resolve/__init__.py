"""Resolve: the store's answers (``answers``) to per-chunk presence (``presence``) to vLLM's
hit rules (``hits``). Imports only leaves of the layout and plan packages."""
