"""``aio-mclookup serve``: the HTTP router of the installed package under uvicorn.

Flags override the environment (:data:`~aio_mclookup.fastapi._serve.ENVIRONMENT`); the settings
are checked before anything starts (exit 2 with the reason), then handed to uvicorn's workers
through the environment. ``--demo`` starts an embedded master (a :class:`LocalMaster`) first,
prints its addresses and, with ``--demo-keys``, stores a demo prompt and prints a request that
finds it. SIGTERM (or Ctrl-C) shuts down gracefully and exits 0; a server that cannot start
(the master unreachable, say) exits 1, bad settings 2.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import importlib.util
import json
import os
import signal
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ._errors import InvalidRequest

__all__ = ["add_serve_parser", "serve"]

_APP = "aio_mclookup.fastapi._serve:app_from_environment"
_GRACE = 5
"""Seconds uvicorn waits for open connections at shut-down (the whole stop stays within 10 s)."""
_DEMO_TOKENS = 512
"""Tokens of the demo prompt (its first half is stored)."""

_EPILOG = """\
examples:
  aio-mclookup serve --demo --demo-keys --layout examples/layouts/single_full_attention.json
  aio-mclookup serve --layout my_model.json --master 10.0.0.5:50051 \\
      --metadata http://10.0.0.5:8080/metadata --host 0.0.0.0 --port 8000 --workers 2

environment (flags win): AIO_MCLOOKUP_LAYOUT, MOONCAKE_MASTER, MOONCAKE_METADATA,
  AIO_MCLOOKUP_HASH_ALGO, AIO_MCLOOKUP_HASH_SEED, AIO_MCLOOKUP_TIMEOUT, AIO_MCLOOKUP_CACHE_TTL,
  AIO_MCLOOKUP_MAX_BODY_BYTES, AIO_MCLOOKUP_MAX_HASHES, AIO_MCLOOKUP_MAX_BATCH,
  AIO_MCLOOKUP_STORE_THREADS, AIO_MCLOOKUP_LOCAL_HOSTNAME
"""

_SETTING_FLAGS = {
    "layout": "layout",
    "master": "master",
    "metadata": "metadata",
    "hash_algo": "hash_algo",
    "hash_seed": "hash_seed",
    "timeout": "timeout",
    "cache_ttl": "cache_ttl",
    "max_body_bytes": "max_body_bytes",
    "max_hashes": "max_hashes_per_request",
    "max_batch": "max_batch_requests",
    "threads": "threads",
    "local_hostname": "local_hostname",
}
"""Flag (argparse dest) -> the :class:`ServeSettings` field it sets."""


def add_serve_parser(sub: Any) -> argparse.ArgumentParser:
    """Add ``serve`` to the sub-commands ``sub``."""
    sv: argparse.ArgumentParser = sub.add_parser(
        "serve",
        help="serve prefix lookups over HTTP (the FastAPI router, under uvicorn)",
        description=(
            "Serve POST /v1/lookup and /v1/lookup/batch (vLLM's scheduler count of a request's "
            "tokens found in the Mooncake store, or SGLang's L3 hit for an SGLang layout file), "
            "GET /v1/layout, /healthz, /readyz (the store "
            "answers an RPC now) and /metrics (Prometheus), with OpenAPI docs at /docs. Needs "
            "the serve extra (from a clone: pip install -e '.[serve,cpu]')."
        ),
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sv.set_defaults(subparser=sv)
    g = sv.add_argument_group("what to serve")
    g.add_argument(
        "--layout",
        metavar="FILE.json",
        help='layout file (KVLayout.from_dict; with "engine": "sglang", SGLangLayout.from_dict)',
    )
    g.add_argument(
        "--hash-algo",
        metavar="NAME",
        help="how token-id bodies are hashed: the engines' --prefix-caching-hash-algo "
        "(default: sha256)",
    )
    g.add_argument("--hash-seed", metavar="SEED", help="the engines' PYTHONHASHSEED")
    g = sv.add_argument_group("store")
    g.add_argument("--master", metavar="ADDR", help="the Mooncake master (passed to the client)")
    g.add_argument("--metadata", metavar="URL", help="its metadata server")
    g.add_argument(
        "--demo",
        action="store_true",
        help="start an embedded master (loopback) for this run and print its addresses",
    )
    g.add_argument(
        "--demo-keys",
        action="store_true",
        help="with --demo: store a demo prompt and print a request that finds half of it",
    )
    g.add_argument("--threads", type=int, metavar="N", help="store client threads (4)")
    g.add_argument(
        "--local-hostname", metavar="ADDR", help="address the client advertises (127.0.0.1)"
    )
    g = sv.add_argument_group("lookups")
    g.add_argument("--timeout", metavar="SECONDS", help="longest one lookup may take (5)")
    g.add_argument(
        "--cache-ttl", metavar="SECONDS", help="positive-answer cache, or 'none' (5)"
    )
    g.add_argument("--max-body-bytes", metavar="N", help="largest request body (5 MiB)")
    g.add_argument("--max-hashes", metavar="N", help="most hashes per prompt (65536)")
    g.add_argument("--max-batch", metavar="N", help="most prompts per batch request (1024)")
    g = sv.add_argument_group("HTTP")
    g.add_argument("--host", default="127.0.0.1", help="address to listen on (127.0.0.1)")
    g.add_argument("--port", type=int, default=8000, help="port to listen on (8000)")
    g.add_argument(
        "--workers",
        type=int,
        default=1,
        metavar="N",
        help="worker processes, each with its own coordinator (1)",
    )
    g.add_argument(
        "--log-level",
        default="info",
        choices=("critical", "error", "warning", "info", "debug"),
        help="uvicorn's log level (info)",
    )
    g.add_argument("--access-log", action="store_true", help="log every request (off)")
    return sv


def serve_settings(args: argparse.Namespace, environ: dict[str, str] | None = None) -> Any:
    """The :class:`ServeSettings` of ``args`` over ``environ`` (``os.environ``), checked
    (:class:`InvalidRequest` with the reason). The master may be missing only with --demo."""
    from .fastapi._serve import ENVIRONMENT, ServeSettings

    env = dict(os.environ if environ is None else environ)
    for dest, name in _SETTING_FLAGS.items():
        value = getattr(args, dest)
        if value is not None:
            env[ENVIRONMENT[name]] = str(value)
    if args.demo:
        if args.master is not None or args.metadata is not None:
            raise InvalidRequest("--demo starts its own master: leave out --master/--metadata")
        env.pop(ENVIRONMENT["master"], None)
        env.pop(ENVIRONMENT["metadata"], None)
    elif args.demo_keys:
        raise InvalidRequest("--demo-keys only applies with --demo")
    for name in ("port", "workers"):
        value = getattr(args, name)
        if value < (0 if name == "port" else 1) or (name == "port" and value > 65535):
            raise InvalidRequest(f"--{name} out of range: {value}")
    settings = ServeSettings.from_environ(env)
    if settings.master is None and not args.demo:
        raise InvalidRequest(
            "no master: give --master and --metadata (or MOONCAKE_MASTER and "
            "MOONCAKE_METADATA), or --demo to start one"
        )
    layout = settings.load_layout()
    settings.load_hasher(layout)  # (a configuration it cannot reproduce fails here)
    return settings


def serve(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """Run ``aio-mclookup serve``; returns the exit code."""
    for module in ("fastapi", "uvicorn"):
        if importlib.util.find_spec(module) is None:
            parser.error(f"{module} is not installed: from a clone, pip install -e '.[serve,cpu]'")
    try:
        settings = serve_settings(args)
    except InvalidRequest as exc:
        parser.error(str(exc))
    stopping: list[int] = []
    previous = {
        sig: signal.signal(sig, lambda number, _frame: stopping.append(number))
        for sig in (signal.SIGTERM, signal.SIGINT)
    }  # (uvicorn restores these after its graceful stop and re-raises into them)
    try:
        with _demo_store(args, settings) as settings:
            if stopping:
                return 0
            os.environ.update(settings.to_environ())  # (the workers read them)
            started = _run_uvicorn(args)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if not started and not stopping:
        _say("the server did not start (the reason is above)")
        return 1
    return 0


def _run_uvicorn(args: argparse.Namespace) -> bool:
    """Serve until stopped; whether the server (or the supervisor of its workers) started."""
    import uvicorn
    from uvicorn.supervisors import Multiprocess

    config = uvicorn.Config(
        _APP,
        factory=True,
        host=args.host,
        port=args.port,
        workers=args.workers,
        log_level=args.log_level,
        access_log=args.access_log,
        lifespan="on",
        timeout_graceful_shutdown=_GRACE,
    )
    if args.workers > 1:
        sock = config.bind_socket()
        Multiprocess(config, sockets=[sock]).run()
        return True
    server = uvicorn.Server(config)
    try:
        server.run()
    except SystemExit:  # (uvicorn's own exit when the app's start-up failed)
        return False
    return bool(server.started)


def _say(message: str) -> None:
    sys.stderr.write(f"aio-mclookup serve: {message}\n")
    sys.stderr.flush()


@contextlib.contextmanager
def _demo_store(args: argparse.Namespace, settings: Any) -> Iterator[Any]:
    """Without --demo: ``settings`` as they are. With it: a :class:`LocalMaster` (and, with
    --demo-keys, a writer holding the demo prompt) while the server runs, and the settings
    pointed at it."""
    if not args.demo:
        yield settings
        return
    from ._local.master import LocalMaster

    master = LocalMaster()
    master.start_blocking()
    try:
        _say(f"demo master at {master.master_address}, metadata server {master.metadata_server}")
        settings = dataclasses.replace(
            settings, master=master.master_address, metadata=master.metadata_server
        )
        if not args.demo_keys:
            yield settings
            return
        with _demo_keys(args, settings):
            yield settings
    finally:
        master.stop_blocking()


@contextlib.contextmanager
def _demo_keys(args: argparse.Namespace, settings: Any) -> Iterator[None]:
    """Store the first half of a demo prompt (synthetic block hashes of a 512-token prompt;
    for an SGLang layout, its pages of token ids) and print a request for the whole prompt,
    with the hit it gets."""
    from . import FakeStore, LookupCoordinator, SGLangLayout
    from ._local.writer import StoreWriter

    layout = settings.load_layout()
    request: dict[str, Any]
    if isinstance(layout, SGLangLayout):  # token ids: SGLang's router has no hashes
        ids = list(range(1000, 1000 + _DEMO_TOKENS))
        hashes = layout.page_hashes(ids)
        written = SGLangLayout.from_dict({**layout.to_dict(), "prefetch_threshold": 0})
        stored = written.plan(_DEMO_TOKENS // 2 + 1, hashes).keys
        request = {"token_ids": ids}
    else:
        hashes = _demo_hashes(layout.hash_block_size, _DEMO_TOKENS // layout.hash_block_size)
        stored = layout.plan(_DEMO_TOKENS // 2, hashes[: len(hashes) // 2]).keys
        request = {"num_tokens": _DEMO_TOKENS, "block_hashes": [h.hex() for h in hashes]}

    async def expected() -> int:
        async with LookupCoordinator(layout, FakeStore(stored)) as coordinator:
            hit: int = await coordinator.lookup(_DEMO_TOKENS, hashes)
            return hit

    stack = contextlib.ExitStack()  # (the request file, removed at the end)
    writer = StoreWriter(settings.master, settings.metadata)
    asyncio.run(writer.open())
    try:
        asyncio.run(writer.put_keys([k.decode() if isinstance(k, bytes) else k for k in stored]))
        hit = asyncio.run(expected())
        folder = stack.enter_context(tempfile.TemporaryDirectory(prefix="aio-mclookup-demo-"))
        body = Path(folder) / "request.json"
        body.write_text(json.dumps(request))
        host = "127.0.0.1" if args.host in ("0.0.0.0", "::") else args.host
        _say(
            f"demo keys: {len(stored)} keys of a {_DEMO_TOKENS}-token prompt stored (its first "
            f"half); it finds {hit} tokens:\n  curl -s -H 'content-type: application/json' "
            f"--data @{body} http://{host}:{args.port}/v1/lookup"
        )
        yield
    finally:
        stack.close()
        asyncio.run(writer.aclose())


def _demo_hashes(block_size: int, count: int) -> list[bytes]:
    """``count`` chained 32-byte block hashes (vLLM's shape: each names its whole prefix)."""
    import hashlib

    out, parent = [], hashlib.sha256(b"aio-mclookup demo %d" % block_size).digest()
    for i in range(count):
        parent = hashlib.sha256(parent + i.to_bytes(4, "little")).digest()
        out.append(parent)
    return out
