"""SGLang page hashing speed: ``SGLangLayout.page_hashes`` against SGLang's per-page Python
rule, same tokens.

The baseline is the rule of ``/work/shared/docs/sglang-hicache.md`` section 2 written the way a
pure-Python fallback computes it: per full page a ``hashlib.sha256()`` object fed the prior
page's hash (carried as 64 hex characters, as SGLang passes it on, and turned back into its 32
bytes) and then each token id's 4 little-endian bytes, one ``update`` per id, then
``hexdigest()``. Ours: ``layout.page_hashes(tokens)`` (ids packed for every page at once, one
hashlib call per page), with the tokens as the same Python list and as a 1-D int64 numpy array.
Before timing, every workload checks that all three give identical hashes.

Workloads (token ids uniform in [0, 151,936), a Qwen-sized vocabulary): 4,096 tokens at page
sizes 64, 16, 4 and 1, 8,192 tokens at page 64 under EAGLE (bigram pages), and a 32,768-token
prompt at page 128. The contenders take turns; each figure is the median of ``--runs`` timed
calls after warm-up calls, the collector left running (a router hashing prompt after prompt).

Usage: ``python benchmarks/bench_sglang_hash.py [--runs N] [--quick]``. It prints a table; it
writes no file.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import random
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from aio_mclookup import SGLangLayout

VOCAB = 151_936
WORKLOADS = [  # (name, tokens, page size, EAGLE)
    ("S1 4,096 tok, page 64", 4096, 64, False),
    ("S2 4,096 tok, page 16", 4096, 16, False),
    ("S3 4,096 tok, page 4", 4096, 4, False),
    ("S4 4,096 tok, page 1", 4096, 1, False),
    ("S5 8,192 tok, page 64, EAGLE", 8192, 64, True),
    ("S6 32,768 tok, page 128", 32768, 128, False),
]


def per_page_python(tokens: list[int], page: int, eagle: bool) -> list[str]:
    """SGLang's rule, page by page in Python (see the module docstring)."""
    units = (len(tokens) - 1 if eagle else len(tokens)) // page * page
    prior: str | None = None
    out = []
    for start in range(0, units, page):
        hasher = hashlib.sha256()
        if prior is not None:
            hasher.update(bytes.fromhex(prior))
        for i in range(start, start + page):
            hasher.update(tokens[i].to_bytes(4, "little"))
            if eagle:
                hasher.update(tokens[i + 1].to_bytes(4, "little"))
        prior = hasher.hexdigest()
        out.append(prior)
    return out


def _median_us(fn: Callable[[], Any], runs: int, warmup: int) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=41, help="timed calls per contender")
    parser.add_argument("--quick", action="store_true", help="5 timed calls each")
    args = parser.parse_args()
    runs = 5 if args.quick else args.runs
    rng = random.Random(0)
    print(f"{'workload':32} {'per-page Python':>16} {'ours (list)':>12} {'ours (array)':>13}"
          f" {'ratio (list)':>13} {'ratio (array)':>14}")
    for name, count, page, eagle in WORKLOADS:
        layout = SGLangLayout(sglang_version="0.5.23", page_size=page, eagle=eagle)
        tokens = [rng.randrange(VOCAB) for _ in range(count)]
        array = np.array(tokens, dtype=np.int64)
        want = per_page_python(tokens, page, eagle)
        assert [h.hex() for h in layout.page_hashes(tokens)] == want, name
        assert [h.hex() for h in layout.page_hashes(array)] == want, name
        contenders: dict[str, Callable[[], Any]] = {
            "base": functools.partial(per_page_python, tokens, page, eagle),
            "list": functools.partial(layout.page_hashes, tokens),
            "array": functools.partial(layout.page_hashes, array),
        }
        times: dict[str, list[float]] = {key: [] for key in contenders}
        for _ in range(3):  # (in turns: a slow spell of the machine hits all three)
            for key, fn in contenders.items():
                times[key].append(_median_us(fn, max(1, runs // 3), warmup=2))
        base, ours, arr = (statistics.median(times[k]) for k in ("base", "list", "array"))
        print(f"{name:32} {base:13.0f} us {ours:9.0f} us {arr:10.0f} us {base / ours:12.1f}x"
              f" {base / arr:13.1f}x")


if __name__ == "__main__":
    main()
