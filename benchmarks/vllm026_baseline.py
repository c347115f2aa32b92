"""The benchmarks' baseline: a faithful pure-Python port of vLLM 0.26's per-request lookup.

It lives in the package (``aio_mclookup._reference``) because the load generator's
``--compare`` mode runs it too; this module is where the benchmarks import it from.
"""

from aio_mclookup._reference.v026 import BaselineLookup

__all__ = ["BaselineLookup"]
