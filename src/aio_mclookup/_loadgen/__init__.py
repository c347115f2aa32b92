"""The load generator: the synthetic workload (``workload``), what runs are configured with and
measure (``results``), the seed-naive baseline (``baseline``), the runs (``run``) and their
report (``report``)."""
