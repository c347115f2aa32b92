"""Local tooling: an embedded loopback master (``master``, HA masters too), a loopback etcd for
them (``etcd``) and a key writer (``writer``), the load generator's default and the test
suite's real parts."""
