"""Observe: live counters and frozen snapshots (``stats``) and their Prometheus exposition
(``prometheus``)."""
