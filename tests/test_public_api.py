"""The public surface: ``aio_mclookup.__all__`` is exactly what the package offers, each name
exists, is documented (a docstring, and a mention in docs/ or the README), and shows as
``aio_mclookup.X``; nothing else public leaks into the namespace."""

from __future__ import annotations

import importlib
import inspect
import pkgutil
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
