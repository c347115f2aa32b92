"""The HTTP router as a ready service: :class:`ServeSettings` (read from the environment, which
``aio-mclookup serve`` fills from its flags) and :func:`create_serve_app`, the app each of its
workers runs (:func:`app_from_environment`, a uvicorn factory)."""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from .. import BlockHasher, CoordinatorOptions, InvalidRequest, KVLayout, SGLangLayout
from ._app import create_app
from ._ready import create_readiness_router

__all__ = [
    "ENVIRONMENT", "ServeSettings", "app_from_environment", "create_serve_app", "layout_from_dict",
]

log = logging.getLogger("uvicorn.error")  # (uvicorn shows it with its own lines)

ENVIRONMENT: dict[str, str] = {
    "layout": "AIO_MCLOOKUP_LAYOUT",
    "master": "MOONCAKE_MASTER",
    "metadata": "MOONCAKE_METADATA",
    "hash_algo": "AIO_MCLOOKUP_HASH_ALGO",
    "hash_seed": "AIO_MCLOOKUP_HASH_SEED",
    "timeout": "AIO_MCLOOKUP_TIMEOUT",
    "cache_ttl": "AIO_MCLOOKUP_CACHE_TTL",
    "max_body_bytes": "AIO_MCLOOKUP_MAX_BODY_BYTES",
    "max_hashes_per_request": "AIO_MCLOOKUP_MAX_HASHES",
    "max_batch_requests": "AIO_MCLOOKUP_MAX_BATCH",
    "threads": "AIO_MCLOOKUP_STORE_THREADS",
    "local_hostname": "AIO_MCLOOKUP_LOCAL_HOSTNAME",
}
"""The environment variable of each :class:`ServeSettings` field."""


_DEFAULT_TTL = CoordinatorOptions().cache_ttl


@dataclasses.dataclass(frozen=True)
class ServeSettings:
    """What the service needs, each field from its variable of :data:`ENVIRONMENT`.

    ``layout`` is the path of a layout JSON file (``SGLangLayout.from_dict`` when it says
    ``"engine": "sglang"``, else ``KVLayout.from_dict``); ``master`` (``host:port``,
    or whatever address ``MooncakeStore`` takes, passed through) and ``metadata`` (the
    metadata server's URL) the Mooncake deployment. ``hash_algo`` and ``hash_seed`` hash
    token-id bodies as the engines do (``--prefix-caching-hash-algo`` and
    ``PYTHONHASHSEED``). ``timeout`` bounds one lookup (seconds); ``cache_ttl`` is the
    positive-answer cache (None: no cache; by default the coordinator's); the ``max_*``
    fields are the router's limits (None: its defaults); ``threads`` and ``local_hostname``
    go to the store.
    """

    layout: str
    master: str | None = None
    metadata: str | None = None
    hash_algo: str | None = None
    hash_seed: str | None = None
    timeout: float = 5.0
    cache_ttl: float | None = _DEFAULT_TTL
    max_body_bytes: int | None = None
    max_hashes_per_request: int | None = None
    max_batch_requests: int | None = None
    threads: int = 4
    local_hostname: str = "127.0.0.1"

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None) -> ServeSettings:
        """Read and check the settings (``os.environ`` by default); a bad or missing value is
        an :class:`~aio_mclookup.InvalidRequest` that names its variable."""
        env = os.environ if environ is None else environ

        def raw(name: str) -> str | None:
            value = env.get(ENVIRONMENT[name])
            return value if value is None or value.strip() else None

        layout = raw("layout")
        if layout is None:
            raise InvalidRequest(
                f"{ENVIRONMENT['layout']} is not set: point it at a JSON KV-cache layout "
                "(KVLayout.from_dict schema), e.g. examples/layouts/single_full_attention.json",
                field=ENVIRONMENT["layout"],
            )
        master, metadata = raw("master"), raw("metadata")
        if (master is None) != (metadata is None):
            raise InvalidRequest(
                f"{ENVIRONMENT['master']} and {ENVIRONMENT['metadata']} go together "
                "(give both, or neither)",
                field=ENVIRONMENT["metadata" if metadata is None else "master"],
            )
        fields: dict[str, Any] = {"layout": layout, "master": master, "metadata": metadata}
        fields["hash_algo"], fields["hash_seed"] = raw("hash_algo"), raw("hash_seed")
        if (text := raw("timeout")) is not None:
            fields["timeout"] = _seconds(text, "timeout", none_ok=False)
        if (text := env.get(ENVIRONMENT["cache_ttl"])) is not None:
            fields["cache_ttl"] = _seconds(text, "cache_ttl", none_ok=True)
        for name in ("max_body_bytes", "max_hashes_per_request", "max_batch_requests", "threads"):
            if (text := raw(name)) is not None:
                fields[name] = _count(text, name)
        if (text := raw("local_hostname")) is not None:
            fields["local_hostname"] = text.strip()
        return cls(**fields)

    def to_environ(self) -> dict[str, str]:
        """The variables that give these settings back through :meth:`from_environ` (what the
        command hands its workers)."""
        out: dict[str, str] = {}
        for name, variable in ENVIRONMENT.items():
            value = getattr(self, name)
            if name == "cache_ttl":
                out[variable] = "none" if value is None else repr(value)
            elif value is not None:
                out[variable] = str(value)
        return out

    def load_layout(self) -> KVLayout | SGLangLayout:
        """The layout file, read and checked (:class:`InvalidRequest` naming the file): an
        :class:`SGLangLayout` for a JSON object with ``"engine": "sglang"``, else a
        :class:`KVLayout`."""
        try:
            return layout_from_dict(json.loads(Path(self.layout).read_text()))
        except OSError as exc:
            raise InvalidRequest(
                f"{ENVIRONMENT['layout']}={self.layout}: cannot read it: {exc.strerror}",
                field=ENVIRONMENT["layout"],
            ) from None
        except (ValueError, TypeError) as exc:  # (InvalidRequest is a ValueError)
            raise InvalidRequest(
                f"{ENVIRONMENT['layout']}={self.layout}: not a valid layout: {exc}",
                field=ENVIRONMENT["layout"],
            ) from None

    def load_hasher(self, layout: KVLayout | SGLangLayout) -> BlockHasher | None:
        """The hasher of token-id bodies (``hash_algo``, ``hash_seed``, the layout's
        ``hash_block_size`` and ``vllm_version``). A configuration whose hashes cannot be
        reproduced is an :class:`InvalidRequest` when either is set; with neither set, the
        service answers block-hash bodies only (None) and logs why. An SGLang layout hashes
        token ids itself (None; ``hash_algo`` or ``hash_seed`` set is refused)."""
        if isinstance(layout, SGLangLayout):
            if self.hash_algo is not None or self.hash_seed is not None:
                name = "hash_algo" if self.hash_algo is not None else "hash_seed"
                raise InvalidRequest(
                    f"{ENVIRONMENT[name]}: SGLang hashes pages with SHA-256 and no seed; "
                    "hash_algo and hash_seed are for vLLM layouts",
                    field=ENVIRONMENT[name],
                )
            return None
        try:
            return BlockHasher(
                layout.hash_block_size,
                algo=self.hash_algo or "sha256",
                seed=self.hash_seed,
                vllm_version=layout.vllm_version,
            )
        except InvalidRequest as exc:
            if self.hash_algo is None and self.hash_seed is None:
                log.warning("token-id bodies are off: %s", exc)
                return None
            raise InvalidRequest(
                f"{ENVIRONMENT['hash_algo']}={self.hash_algo or 'sha256'!r}: {exc}",
                field=ENVIRONMENT["hash_algo"],
            ) from None

    def coordinator_options(self) -> dict[str, Any]:
        """The coordinator's options: ``timeout`` and ``cache_ttl``."""
        return {"timeout": self.timeout, "cache_ttl": self.cache_ttl}

    def router_options(self) -> dict[str, Any]:
        """The router's limits that are set."""
        names = ("max_body_bytes", "max_hashes_per_request", "max_batch_requests")
        return {name: getattr(self, name) for name in names if getattr(self, name) is not None}


def _seconds(text: str, name: str, *, none_ok: bool) -> float | None:
    variable = ENVIRONMENT[name]
    if none_ok and text.strip().lower() == "none":
        return None
    try:
        value = float(text)
        if not (value > 0 and math.isfinite(value)):
            raise ValueError
        if name == "cache_ttl":
            CoordinatorOptions(cache_ttl=value)  # (the coordinator's own check)
    except (ValueError, InvalidRequest):
        what = "seconds (> 0) or 'none'" if none_ok else "seconds (> 0)"
        raise InvalidRequest(f"{variable}={text!r}: give {what}", field=variable) from None
    return value


def _count(text: str, name: str) -> int:
    variable = ENVIRONMENT[name]
    try:
        value = int(text)
        if value < 1:
            raise ValueError
    except ValueError:
        raise InvalidRequest(f"{variable}={text!r}: give an integer >= 1", field=variable) from None
    return value


def create_serve_app(settings: ServeSettings) -> Any:
    """The service of ``settings``: :func:`create_app` (the router with token-id hashing,
    the coordinator's lifespan on a ``MooncakeStore``, the fast path) and ``GET /readyz``.
    Raises :class:`InvalidRequest` for settings it cannot serve (no master, a bad layout, a
    hash configuration it cannot reproduce)."""
    if settings.master is None or settings.metadata is None:
        raise InvalidRequest(
            f"{ENVIRONMENT['master']} and {ENVIRONMENT['metadata']} are not set: the service "
            "needs a Mooncake master (aio-mclookup serve --demo starts one)",
            field=ENVIRONMENT["master"],
        )
    layout = settings.load_layout()
    hasher = settings.load_hasher(layout)
    app = create_app(
        layout,
        master_address=settings.master,
        metadata_server=settings.metadata,
        store_options={"threads": settings.threads, "local_hostname": settings.local_hostname},
        router_options={"hasher": hasher, **settings.router_options()},
        **settings.coordinator_options(),
    )
    app.include_router(create_readiness_router())
    if isinstance(layout, SGLangLayout):
        log.info(
            "aio-mclookup serving %s (SGLang %s HiCache rules, token ids hashed in %d-token "
            "pages) against %s",
            layout.model_name,
            layout.sglang_version,
            layout.page_size,
            settings.master,
        )
        return app
    log.info(
        "aio-mclookup serving %s (vLLM %s rules, token ids hashed with %s) against %s",
        layout.model,
        layout.vllm_version,
        hasher.algo if hasher is not None else "nothing",
        settings.master,
    )
    return app


def layout_from_dict(cfg: object) -> KVLayout | SGLangLayout:
    """The layout of a layout file's JSON: :meth:`SGLangLayout.from_dict` for an object
    with ``"engine": "sglang"``, else :meth:`KVLayout.from_dict` (``"engine": "vllm"`` may
    say so)."""
    if isinstance(cfg, Mapping) and "engine" in cfg:
        engine = cfg["engine"]
        if engine == "sglang":
            return SGLangLayout.from_dict(cfg)
        if engine != "vllm":
            raise InvalidRequest(
                f'"engine" must be "vllm" or "sglang", got {engine!r}', field="engine"
            )
        cfg = {k: v for k, v in cfg.items() if k != "engine"}
    return KVLayout.from_dict(cfg)  # type: ignore[arg-type]


def app_from_environment() -> Any:
    """:func:`create_serve_app` of :meth:`ServeSettings.from_environ` (uvicorn's factory in
    each worker of ``aio-mclookup serve``); bad settings raise :class:`RuntimeError` with the
    reason, which uvicorn prints before it exits."""
    try:
        return create_serve_app(ServeSettings.from_environ())
    except InvalidRequest as exc:
        raise RuntimeError(str(exc)) from None
