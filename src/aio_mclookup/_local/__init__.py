"""Local tooling: an embedded loopback master (``master``) and a key writer (``writer``), the
load generator's default and the test suite's real parts."""
