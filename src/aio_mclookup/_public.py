"""How public names present themselves: as ``aio_mclookup.X`` (in reprs, docs and
tracebacks), not as the private module that defines them, whichever module imports them
first (``__init__`` loads some of them only on first use)."""

from __future__ import annotations

__all__ = ["present_as_public"]


def present_as_public(*objects: object) -> None:
    """Give each class or function defined in a private module ``__module__ = "aio_mclookup"``."""
    for obj in objects:
        if callable(obj) and getattr(obj, "__module__", "").startswith("aio_mclookup._"):
            obj.__module__ = "aio_mclookup"
