"""The compiled extensions: one behaviour, two speeds (docs/design.md, "Compiled extensions").

Each extension is the compiled twin of pure-Python code that stays as the reference and the
fallback; it lives under its own module name (``_chain_c`` beside ``_hasher``), so nothing
about Python's import order decides which runs: :func:`load` does. It returns the extension
module, or ``None`` (the caller then runs its pure-Python code) when the extension was not
built (no compiler at install time) or ``AIO_MCLOOKUP_NO_EXTENSIONS=1`` is set; it logs its
choice once per extension at DEBUG. :func:`loaded` tells which path each one took.
"""

from __future__ import annotations

import importlib
import logging
import os
from types import ModuleType

__all__ = ["ENV_VAR", "disabled", "load", "loaded"]

ENV_VAR = "AIO_MCLOOKUP_NO_EXTENSIONS"
"""Set to ``1`` (or any value but empty and ``0``) to run the pure-Python code everywhere."""

logger = logging.getLogger("aio_mclookup")

_choices: dict[str, bool] = {}


def disabled() -> bool:
    """Whether :data:`ENV_VAR` asks for the pure-Python code."""
    return os.environ.get(ENV_VAR, "") not in ("", "0")


def load(name: str) -> ModuleType | None:
    """The extension module ``name`` (absolute), or ``None``: run the pure-Python code."""
    module: ModuleType | None = None
    if disabled():
        why = f"{ENV_VAR} is set"
    else:
        try:
            module = importlib.import_module(name)
            why = "built"
        except ImportError as exc:
            why = f"not built ({exc})"
    if name not in _choices:
        path = "compiled" if module is not None else "pure Python"
        logger.debug("aio_mclookup: %s: %s (%s)", name, path, why)
    _choices[name] = module is not None
    return module


def loaded() -> dict[str, bool]:
    """Per extension asked for so far: ``True`` if the compiled one runs."""
    return dict(_choices)
