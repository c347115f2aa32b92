"""Exactness oracles: literal, slow ports of each vLLM release's worker-side lookup.

They are the baselines of the benchmarks and the oracles of the property tests; nothing on the
fast path imports them.
"""
