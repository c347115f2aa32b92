"""The public surface: ``aio_mclookup.__all__`` is exactly what the package offers, each name
exists, is documented (a docstring, and a mention in docs/ or the README), and shows as
``aio_mclookup.X``; nothing else public leaks into the namespace."""

from __future__ import annotations

import importlib
import inspect
import pkgutil
import subprocess
import sys
from pathlib import Path

import pytest

import aio_mclookup

ROOT = Path(__file__).resolve().parents[1]
DOCS = "\n".join(p.read_text() for p in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))])


@pytest.mark.parametrize("name", aio_mclookup.__all__)
def test_every_exported_name_exists_is_documented_and_looks_public(name: str) -> None:
    obj = getattr(aio_mclookup, name)
    if inspect.isclass(obj) or inspect.isfunction(obj):
        assert (obj.__doc__ or "").strip(), f"{name} has no docstring"
        assert obj.__module__ == "aio_mclookup", f"{name} shows as {obj.__module__}"
    assert f"`{name}" in DOCS or f"{name}(" in DOCS or f".{name}" in DOCS, (
        f"{name} is mentioned nowhere in README.md or docs/"
    )


def test_all_is_sorted_and_has_no_duplicates() -> None:
    names = aio_mclookup.__all__
    assert len(set(names)) == len(names)
    assert sorted(names, key=lambda n: (not n.isupper(), n.lower())) == sorted(
        names, key=lambda n: (not n.isupper(), n.lower())
    )


def test_nothing_public_beyond_all() -> None:
    public = {n for n in vars(aio_mclookup) if not n.startswith("_")}
    submodules = {m.name for m in pkgutil.iter_modules(aio_mclookup.__path__)}
    assert public - set(aio_mclookup.__all__) - submodules == set()


def test_every_module_imports_alone() -> None:
    """No import cycle hides behind import order: each module imports in a fresh interpreter
    state of its own package (checked here by importing every module by name)."""
    for info in pkgutil.walk_packages(aio_mclookup.__path__, "aio_mclookup."):
        if info.name in ("aio_mclookup.vllm", "aio_mclookup.fastapi"):
            continue  # (optional extras; imported by their own tests)
        importlib.import_module(info.name)


def _fresh_python(code: str) -> str:
    """What ``code`` prints in a fresh interpreter (nothing imported yet)."""
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    ).stdout


def test_names_a_lookup_does_not_need_load_on_first_use() -> None:
    """``import aio_mclookup`` leaves out the hasher, the embedded master and Prometheus (and
    cbor2, which only the hasher needs) until one of them is read."""
    code = (
        "import sys, aio_mclookup as m\n"
        "lazy = ['aio_mclookup._hashing', 'aio_mclookup._local', "
        "'aio_mclookup._observe.prometheus', 'cbor2']\n"
        "print(sorted(n for n in lazy if n in sys.modules))\n"
        "m.BlockHasher; m.LocalMaster; m.prometheus_text\n"
        "print(sorted(n for n in lazy if n in sys.modules))\n"
    )
    out = _fresh_python(code).split("\n")
    assert out[0] == "[]"
    assert out[1] == str(
        ["aio_mclookup._hashing", "aio_mclookup._local", "aio_mclookup._observe.prometheus",
         "cbor2"]
    )


def test_an_unknown_name_is_an_attribute_error() -> None:
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        aio_mclookup.nope  # noqa: B018
    assert "BlockHasher" in dir(aio_mclookup)


def test_names_loaded_on_first_use_look_public_whoever_imports_them_first() -> None:
    """The routers and the load generator import these from their private modules: they must
    show as ``aio_mclookup.X`` there too, before the package attribute is ever read."""
    code = (
        "from aio_mclookup._hashing import BlockHasher\n"
        "from aio_mclookup._local.master import LocalMaster\n"
        "from aio_mclookup._local.writer import StoreWriter\n"
        "from aio_mclookup._observe.prometheus import CoordinatorCollector, prometheus_text\n"
        "print(sorted({o.__module__ for o in (BlockHasher, LocalMaster, StoreWriter,\n"
        "      CoordinatorCollector, prometheus_text)}))\n"
    )
    assert _fresh_python(code).strip() == "['aio_mclookup']"
