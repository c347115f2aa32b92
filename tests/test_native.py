"""The compiled extensions (``aio_mclookup._native``): which path loads, and that both give the
same answers. The whole suite runs on both paths in CI (``.ci/run``, the second time with
``AIO_MCLOOKUP_NO_EXTENSIONS=1``); here the two are compared side by side in one process.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import subprocess
import sys
from typing import Any

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from aio_mclookup import BlockHasher, InvalidRequest, _native
from aio_mclookup._hashing import _hasher
from test_hashing import SETTINGS, reference_hashes, rows

CHAIN = "aio_mclookup._hashing._chain_c"
ROWS = "aio_mclookup._rows_c"
SEARCH = "aio_mclookup._resolve._search_c"
PROBING = "aio_mclookup._plan._probing_c"
PREFIX_PROBE = "aio_mclookup._plan._prefix_probe_c"
KEYS = "aio_mclookup._plan._keys_c"
REPEATS = "aio_mclookup._plan._repeats_c"
TABLE = "aio_mclookup._coordinator._table_c"
PREFIXES = "aio_mclookup._coordinator._prefixes_c"
WORKER = "aio_mclookup._coordinator._worker_c"
BUILT = importlib.util.find_spec(CHAIN) is not None
EXTENSIONS = {
    name: importlib.util.find_spec(name) is not None
    for name in (CHAIN, ROWS, SEARCH, PROBING, PREFIX_PROBE, KEYS, REPEATS, TABLE, PREFIXES, WORKER)
}
"""Every extension setup.py builds, and whether it was built here."""
needs_build = pytest.mark.skipif(not BUILT, reason="the C extension is not built")
C_CHAIN: Any = importlib.import_module(CHAIN) if BUILT else None
"""The extension itself, whichever path this process runs (the comparisons set each in turn)."""

_PROBE = """
import json, logging
logging.basicConfig(level=logging.DEBUG, format="%(message)s")
from aio_mclookup import BlockHasher, LookupCoordinator, _native
BlockHasher(16).hash(list(range(64)))
print(json.dumps(_native.loaded()))
"""


def _probe(no_extensions: str | None) -> tuple[dict[str, bool], str]:
    env = dict(os.environ)
    env.pop(_native.ENV_VAR, None)
    if no_extensions is not None:
        env[_native.ENV_VAR] = no_extensions
    done = subprocess.run([sys.executable, "-c", _PROBE], env=env, capture_output=True,
                          text=True, timeout=60, check=True)
    return json.loads(done.stdout), done.stderr


def test_the_compiled_path_loads_when_built() -> None:
    missing = [name for name, built in EXTENSIONS.items() if not built]
    if missing and os.environ.get("CI"):
        pytest.fail(f"{missing} not built: run.sh builds them (needs gcc, python3-dev, libssl-dev)")
    loaded, log = _probe(None if not os.environ.get(_native.ENV_VAR) else "0")
    assert loaded == EXTENSIONS
    for name, built in EXTENSIONS.items():
        want = "compiled (built)" if built else "pure Python (not built"
        assert log.count(f"aio_mclookup: {name}: {want}") == 1, log


@pytest.mark.parametrize("value", ["1", "yes"])
def test_the_env_var_selects_pure_python(value: str) -> None:
    loaded, log = _probe(value)
    assert loaded == dict.fromkeys(EXTENSIONS, False)
    for name in EXTENSIONS:
        assert log.count(f"aio_mclookup: {name}: pure Python ({_native.ENV_VAR} is set)") == 1, log


def test_this_process_runs_the_path_its_environment_asks_for() -> None:
    from aio_mclookup import _rows
    from aio_mclookup._coordinator import shell, table
    from aio_mclookup._plan import era_c as plan_era_c
    from aio_mclookup._plan import keys, probing_era_c, rounds
    from aio_mclookup._resolve import era_c

    assert (_hasher._C is not None) == (BUILT and not _native.disabled())
    assert _native.loaded()[CHAIN] == (_hasher._C is not None)
    assert (_rows._C is not None) == (EXTENSIONS[ROWS] and not _native.disabled())
    assert _native.loaded()[ROWS] == (_rows._C is not None)
    assert (era_c._C is not None) == (EXTENSIONS[SEARCH] and not _native.disabled())
    assert _native.loaded()[SEARCH] == (era_c._C is not None)
    assert (probing_era_c._C is not None) == (EXTENSIONS[PROBING] and not _native.disabled())
    assert _native.loaded()[PROBING] == (probing_era_c._C is not None)
    assert (rounds._C is not None) == (EXTENSIONS[PREFIX_PROBE] and not _native.disabled())
    assert _native.loaded()[PREFIX_PROBE] == (rounds._C is not None)
    assert (keys._C is not None) == (EXTENSIONS[KEYS] and not _native.disabled())
    assert keys.COMPILED == (keys._C is not None) == _native.loaded()[KEYS]
    assert (plan_era_c._REPEATS is not None) == (EXTENSIONS[REPEATS] and not _native.disabled())
    assert _native.loaded()[REPEATS] == (plan_era_c._REPEATS is not None)
    assert (shell._WORKER is not None) == (EXTENSIONS[WORKER] and not _native.disabled())
    assert _native.loaded()[WORKER] == (shell._WORKER is not None)
    assert (table._C is not None) == (EXTENSIONS[TABLE] and not _native.disabled())
    assert _native.loaded()[TABLE] == (table._C is not None)


def _both(monkeypatch: pytest.MonkeyPatch, hasher: BlockHasher, tokens: object,
          **kw: object) -> tuple[list[bytes], list[bytes]]:
    with monkeypatch.context() as m:
        m.setattr(_hasher, "_C", C_CHAIN)
        compiled = hasher.hash(tokens, **kw)  # type: ignore[arg-type]
    assert compiled.flags.writeable and compiled.shape[1] == hasher.width
    with monkeypatch.context() as m:
        m.setattr(_hasher, "_C", None)
        pure = hasher.hash(tokens, **kw)  # type: ignore[arg-type]
    return rows(compiled), rows(pure)


@needs_build
@SETTINGS
@given(data=st.data(), block=st.integers(1, 40), algo=st.sampled_from(["sha256", "sha256_cbor"]),
       as_array=st.booleans())
def test_both_paths_agree(data: st.DataObject, block: int, algo: str, as_array: bool) -> None:
    ids = data.draw(st.lists(st.one_of(st.integers(0, 300), st.integers(0, 2**32 + 5),
                                       st.integers(0, 2**63 - 1),
                                       st.sampled_from([0, 23, 24, 255, 256, 65535, 65536,
                                                        2**31 - 1, 2**31, 2**32 - 1, 2**32])),
                             max_size=200))
    parent = data.draw(st.one_of(st.none(), st.binary(min_size=32, max_size=32)))
    lora = data.draw(st.booleans())
    hasher = BlockHasher(block, algo=algo, seed="0")
    tokens: object = np.array(ids, dtype=np.int64) if as_array else ids
    kw: dict[str, object] = {"lora_name": "a", "lora_path": "/l/a"} if lora else {}
    with pytest.MonkeyPatch.context() as m:
        compiled, pure = _both(m, hasher, tokens, parent=parent, **kw)
    assert compiled == pure
    if parent is None:
        assert compiled == reference_hashes(ids, block, algo, lora=("a", "/l/a") if lora else None)


@needs_build
@pytest.mark.parametrize("algo", ["sha256", "sha256_cbor"])
def test_both_paths_agree_on_long_prompts(monkeypatch: pytest.MonkeyPatch, algo: str) -> None:
    ids = np.random.default_rng(3).integers(0, 151_936, 131_075)  # past one 65,536-token chunk
    hasher = BlockHasher(4, algo=algo, seed="0")
    compiled, pure = _both(monkeypatch, hasher, ids)
    assert len(compiled) == 32_768 and compiled == pure
    listed, _ = _both(monkeypatch, hasher, ids.tolist())
    assert listed == compiled


@needs_build
def test_what_the_c_loop_refuses_takes_the_python_path(monkeypatch: pytest.MonkeyPatch) -> None:
    # a pickle past one frame (block 20,000 of 5-byte records), and an id >= 2**63
    ids = np.random.default_rng(4).integers(2**24, 2**31, 40_000).tolist()
    hasher = BlockHasher(20_000, seed="0")
    assert C_CHAIN.plain(np.array(ids, dtype=np.uint64), 20_000, False, bytes(32)) is None
    compiled, pure = _both(monkeypatch, hasher, ids)
    assert compiled == pure == reference_hashes(ids, 20_000)
    with pytest.raises(InvalidRequest, match=r"outside 0\.\.2"):
        BlockHasher(2, seed="0").hash(np.array([1, 2, 3, 2**63], dtype=np.uint64))
    assert C_CHAIN.plain(np.array([1, 2**63], dtype=np.uint64), 2, True, bytes(32)) is None


@needs_build
def test_the_c_loop_checks_its_arguments() -> None:
    chain = C_CHAIN
    with pytest.raises(ValueError, match="32 bytes"):
        chain.plain(np.zeros(4, dtype=np.uint32), 2, False, bytes(16))
    with pytest.raises(TypeError, match="1-D buffer"):
        chain.plain(np.zeros((2, 2), dtype=np.uint32), 2, False, bytes(32))
    with pytest.raises(TypeError, match="1-D buffer"):
        chain.plain(np.zeros(4, dtype=np.float64), 2, False, bytes(32))
    with pytest.raises(ValueError, match="block_size"):
        chain.plain(np.zeros(4, dtype=np.uint32), 0, False, bytes(32))
    with pytest.raises(TypeError, match="sequence of bytes"):
        chain.bodies(bytes(32), [b"x", "y"], True)
    assert chain.bodies(bytes(32), [], False) == bytearray()
