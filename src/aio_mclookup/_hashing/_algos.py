"""The four vLLM prefix-caching hash algorithms: serialisation, digest and width."""

from __future__ import annotations

import hashlib
import pickle
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import cbor2

from .._errors import InvalidRequest

__all__ = ["ALGOS", "Algo", "get_algo"]

ALGOS = ("sha256", "sha256_cbor", "xxhash", "xxhash_cbor")

Digest = Callable[[Any], bytes]


@dataclass(frozen=True)
class Algo:
    """One algorithm: ``digest(serialize(obj))`` is vLLM's ``hash_fn(obj)``."""

    name: str
    cbor: bool  # canonical CBOR, else pickle protocol 5
    width: int  # digest bytes
    digest: Digest  # bytes-like -> digest
    sha256: bool  # digest is hashlib.sha256 (the chain loop then calls the constructor)

    def serialize(self, obj: object) -> bytes:
        if self.cbor:
            return cbor2.dumps(obj, canonical=True)
        return pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)

    def hash_object(self, obj: object) -> bytes:
        """vLLM's ``hash_fn(obj)``: the digest of the serialised object."""
        return self.digest(self.serialize(obj))


def _sha256(data: Any) -> bytes:
    return hashlib.sha256(data).digest()


def _xxh3_128() -> Digest:
    try:
        import xxhash
    except ImportError:
        fn = None
    else:
        fn = getattr(xxhash, "xxh3_128_digest", None)
    if fn is None:
        raise InvalidRequest(
            "the xxhash algorithms need the xxhash package (>= 3.0, with xxh3_128_digest): "
            "pip install 'xxhash>=3.0' (from a clone: pip install -e '.[xxhash]')",
            field="algo",
        )
    digest: Digest = fn
    return digest


def get_algo(name: object) -> Algo:
    """The :class:`Algo` named ``name`` (vLLM's ``prefix_caching_hash_algo``)."""
    if not isinstance(name, str) or name not in ALGOS:
        raise InvalidRequest(
            f"algo must be one of {', '.join(ALGOS)} (vLLM's --prefix-caching-hash-algo), "
            f"not {name!r}",
            field="algo",
        )
    if name.startswith("sha256"):
        return Algo(name, name.endswith("_cbor"), 32, _sha256, True)
    return Algo(name, name.endswith("_cbor"), 16, _xxh3_128(), False)
