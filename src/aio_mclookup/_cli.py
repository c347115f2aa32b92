"""The ``aio-mclookup`` command line (also ``python -m aio_mclookup``).

``aio-mclookup loadgen`` with no arguments starts a loopback Mooncake master, fills it with a
synthetic chat cache, and measures the coordinator against vLLM's per-request way. Exit codes:
0 done, 1 the run failed or runs disagreed on hits, 2 bad arguments, 130 interrupted.
``aio-mclookup layout`` checks a layout file; ``aio-mclookup serve`` (:mod:`._cli_serve`) serves
lookups over HTTP.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.util
import json
import os
import sys
import tempfile
from collections.abc import Coroutine, Iterator, Sequence
from typing import Any, NoReturn, TextIO, TypeVar

from ._cli_serve import add_serve_parser, serve
from ._errors import InvalidRequest
from ._layout.layout import KVLayout
from ._layout.sglang import SGLangLayout
from ._loadgen.workload import PRESETS, SGLANG_PRESETS, WorkloadSpec, preset_layout

__all__ = ["build_parser", "main"]

_T = TypeVar("_T")

DEFAULT_CONCURRENCY = "1,16,64,256"

_EPILOG = """\
examples:
  aio-mclookup loadgen                                  # embedded master, chat preset, --compare
  aio-mclookup loadgen --preset dsv4 --concurrency 64 --report dsv4.png
  aio-mclookup loadgen --preset sessions --concurrency 64 --token-ids
  aio-mclookup loadgen --layout my_model.json --requests 20000 --json out.json
  aio-mclookup loadgen --master 10.0.0.5:50051 --metadata http://10.0.0.5:8080/metadata
"""


class _Parser(argparse.ArgumentParser):
    """An ArgumentParser whose ``error`` exits 2 with the usage and one clear line."""

    def error(self, message: str) -> NoReturn:
        self.print_usage(sys.stderr)
        self.exit(2, f"{self.prog}: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    """The ``aio-mclookup`` parser (sub-commands ``loadgen``, ``layout``, ``serve``)."""
    parser = _Parser(
        prog="aio-mclookup",
        description="Coalescing asyncio prefix lookups for the Mooncake KV-cache store.",
    )
    from . import __version__

    parser.add_argument("--version", action="version", version=f"aio-mclookup {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    lg = sub.add_parser(
        "loadgen",
        help="measure lookups/s and latency against a Mooncake master",
        description=(
            "Fill a Mooncake store with a synthetic vLLM-like KV cache (shared system prompts, "
            "multi-turn sessions) and measure prefix lookups through the coordinator, side by "
            "side with vLLM's per-request way for the layout's release (--compare). Each lookup "
            "answers what vLLM's scheduler counts as found for the request (0.26: aligned, "
            "looked up, one token left; 0.32+: the worker's answer for num_tokens)."
        ),
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )

    lg.set_defaults(subparser=lg)
    ly = sub.add_parser(
        "layout",
        help="check a layout file: release, groups, namespaces, alignment, sample keys",
        description=(
            "Read a layout (KVLayout.from_dict JSON) and print what aio-mclookup will do with "
            "it: the vLLM release whose rules apply, the groups and merged spec-groups, the "
            "rank namespaces of each store group, the lookup alignment, and the key of chunk 0 "
            "of each group for a given hash, to compare with a key your workers wrote."
        ),
    )
    ly.set_defaults(subparser=ly)
    add_serve_parser(sub)
    ly.add_argument("file", metavar="FILE.json", help="the layout file")
    ly.add_argument(
        "--hash",
        default="00" * 32,
        metavar="HEX",
        help="the block hash a group's chunk 0 is keyed by (block_hashes[block_size / "
        "hash_block_size - 1]); default: 32 zero bytes",
    )
    g = lg.add_argument_group("layout (one of)")
    ex = g.add_mutually_exclusive_group()
    ex.add_argument(
        "--preset",
        metavar="NAME",
        help=f"named layout: {', '.join(sorted([*PRESETS, *SGLANG_PRESETS]))} (default: "
        "chat); sessions also sets its workload (128 sessions, every turn asked for); sglang is "
        "an SGLang HiCache deployment, its prompts token ids, its seed-naive way one "
        "batch_exists per querying rank",
    )
    ex.add_argument(
        "--layout",
        metavar="FILE.json",
        help='layout file in the KVLayout.from_dict schema (with "engine": "sglang", '
        "SGLangLayout.from_dict)",
    )

    g = lg.add_argument_group("store")
    g.add_argument(
        "--master",
        metavar="HOST:PORT",
        help="an existing Mooncake master (default: start one); etcd://HOST:PORT[;HOST:PORT...] "
        "for HA masters (the lookups follow the leader)",
    )
    g.add_argument("--metadata", metavar="URL", help="its metadata server (needed with --master)")
    g.add_argument(
        "--write",
        action="store_true",
        help="with --master: write the synthetic cache there too (default: read-only); the "
        "keys live only while this run does",
    )
    g.add_argument(
        "--local-hostname",
        default="127.0.0.1",
        metavar="ADDR",
        help="address the Mooncake clients advertise (default: 127.0.0.1)",
    )

    g = lg.add_argument_group("load")
    g.add_argument(
        "-c",
        "--concurrency",
        default=DEFAULT_CONCURRENCY,
        metavar="N[,N...]",
        help=f"concurrent callers; a list runs a sweep (default: {DEFAULT_CONCURRENCY})",
    )
    ex = g.add_mutually_exclusive_group()
    ex.add_argument(
        "-n",
        "--requests",
        type=int,
        metavar="N",
        help="lookups per run (default: every workload request once)",
    )
    ex.add_argument("--duration", type=float, metavar="SECONDS", help="seconds per run instead")
    g.add_argument(
        "--compare",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also run the seed-naive way (vLLM's loop, one RPC per request) on the same "
        "requests and check both find the same hits (default: on)",
    )
    g.add_argument(
        "--loop",
        choices=("auto", "uvloop", "asyncio"),
        default="auto",
        help="event loop (default: uvloop when installed)",
    )

    g = lg.add_argument_group("workload (defaults depend on the layout; see docs/loadgen.md)")
    g.add_argument(
        "--sessions",
        type=int,
        metavar="N",
        help="chat sessions, one distinct request each (chat: 6000, dsv4: 1200; sessions: 128, "
        "one request per turn)",
    )
    g.add_argument(
        "--turns", type=int, metavar="N", help="most turns a session has had (default: 6)"
    )
    g.add_argument("--system-prompts", type=int, metavar="N", help="shared system prompts")
    g.add_argument("--system-tokens", metavar="LO-HI", help="system prompt length range")
    g.add_argument("--turn-tokens", metavar="LO-HI", help="tokens each turn adds")
    g.add_argument(
        "--hit-ratio",
        type=float,
        metavar="F",
        help="fraction of sessions whose earlier turns are cached (default: 0.8)",
    )
    g.add_argument("--seed", type=int, default=0, help="workload seed (default: 0)")
    g.add_argument(
        "--token-ids",
        action="store_true",
        help="prompts as synthetic token ids: every lookup, both ways, hashes its prompt with "
        "vLLM's block hash (BlockHasher) first, and that time is in its figures",
    )

    g = lg.add_argument_group("coordinator")
    g.add_argument(
        "--timeout",
        type=float,
        metavar="SECONDS",
        help="per-lookup timeout (default: none, like the seed-naive way; the store's RPC "
        "timeout still bounds every call)",
    )
    g.add_argument("--threads", type=int, default=4, metavar="N", help="store client threads (4)")
    g.add_argument(
        "--max-keys-per-rpc", type=int, default=1000, metavar="N", help="keys per RPC (1000)"
    )
    g.add_argument(
        "--max-rpcs-in-flight", type=int, default=2, metavar="N", help="parallel RPCs (2)"
    )
    g.add_argument(
        "--cache-ttl",
        type=float,
        default=5.0,
        metavar="SECONDS",
        help="positive-answer cache; 0 disables (5)",
    )
    g.add_argument(
        "--linger", type=float, default=0.0, metavar="SECONDS", help="dispatch linger (0)"
    )
    g.add_argument(
        "--rounds",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="probe in rounds (default: on)",
    )

    g = lg.add_argument_group("output")
    g.add_argument("--json", metavar="FILE", help="write the results as JSON ('-': stdout)")
    g.add_argument("--report", metavar="FILE.png", help="write a PNG report (needs matplotlib)")
    g.add_argument(
        "--mooncake-log",
        metavar="FILE",
        help="keep the Mooncake client's own log output in FILE (default: a temporary file, "
        "shown only when the run fails)",
    )
    g.add_argument(
        "--progress",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="live progress on stderr (default: when stderr is a terminal)",
    )
    return parser


def _range(text: str, name: str) -> tuple[int, int]:
    parts = text.split("-")
    try:
        if len(parts) == 1:
            low = high = int(parts[0])
        elif len(parts) == 2:
            low, high = int(parts[0]), int(parts[1])
        else:
            raise ValueError
    except ValueError:
        raise InvalidRequest(f"{name} must be N or LO-HI (tokens), got {text!r}") from None
    if low < 0 or high < low:
        raise InvalidRequest(f"{name} must satisfy 0 <= LO <= HI, got {text!r}")
    return low, high


def _concurrency(text: str) -> tuple[int, ...]:
    values: list[int] = []
    for part in text.split(","):
        try:
            value = int(part)
        except ValueError:
            raise InvalidRequest(
                f"--concurrency must be integers >= 1 separated by commas, got {text!r}"
            ) from None
        if value < 1:
            raise InvalidRequest(f"--concurrency must be >= 1, got {value}")
        if value not in values:
            values.append(value)
    return tuple(values)


def _load_layout(args: argparse.Namespace) -> tuple[KVLayout | SGLangLayout, str]:
    if args.layout is not None:
        try:
            with open(args.layout, encoding="utf-8") as f:
                raw = json.load(f)
        except OSError as exc:
            raise InvalidRequest(f"--layout: cannot read {args.layout}: {exc.strerror}") from None
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise InvalidRequest(f"--layout: {args.layout} is not valid JSON: {exc}") from None
        try:
            if isinstance(raw, dict) and raw.get("engine") == "sglang":
                return SGLangLayout.from_dict(raw), args.layout
            return KVLayout.from_dict(raw), args.layout
        except InvalidRequest as exc:
            raise InvalidRequest(f"--layout: {args.layout} is not a valid layout: {exc}") from None
        except (TypeError, ValueError) as exc:
            raise InvalidRequest(f"--layout: {args.layout} is not a valid layout: {exc}") from None
    name = args.preset or "chat"
    try:
        return preset_layout(name), f"preset {name}"
    except InvalidRequest as exc:
        raise InvalidRequest(f"--preset: {exc}") from None


def _config(args: argparse.Namespace, stderr: TextIO) -> Any:
    """Validate the parsed arguments into a :class:`LoadgenConfig` (InvalidRequest if bad)."""
    from ._loadgen.results import LoadgenConfig

    layout, source = _load_layout(args)
    concurrency = _concurrency(args.concurrency)
    if (args.master is None) != (args.metadata is None):
        raise InvalidRequest("--master and --metadata go together (give both, or neither)")
    if args.write and args.master is None:
        raise InvalidRequest("--write only applies with --master (the embedded store is filled)")
    for name in ("requests", "sessions", "turns", "system_prompts", "threads"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise InvalidRequest(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    for name in ("max_keys_per_rpc", "max_rpcs_in_flight"):
        if getattr(args, name) < 1:
            raise InvalidRequest(f"--{name.replace('_', '-')} must be >= 1")
    if args.duration is not None and not args.duration > 0:
        raise InvalidRequest(f"--duration must be > 0, got {args.duration}")
    if args.timeout is not None and not args.timeout > 0:
        raise InvalidRequest(f"--timeout must be > 0, got {args.timeout}")
    if args.cache_ttl < 0 or args.linger < 0:
        raise InvalidRequest("--cache-ttl and --linger must be >= 0")
    if args.hit_ratio is not None and not 0.0 <= args.hit_ratio <= 1.0:
        raise InvalidRequest(f"--hit-ratio must be within [0, 1], got {args.hit_ratio}")
    if args.report is not None and not args.report.lower().endswith(".png"):
        raise InvalidRequest(f"--report must name a .png file, got {args.report!r}")
    overrides: dict[str, Any] = {
        "sessions": args.sessions,
        "turns": args.turns,
        "system_prompts": args.system_prompts,
        "hit_ratio": args.hit_ratio,
        "seed": args.seed,
        "token_ids": args.token_ids or None,
    }
    if args.system_tokens is not None:
        overrides["system_tokens"] = _range(args.system_tokens, "--system-tokens")
    if args.turn_tokens is not None:
        overrides["turn_tokens"] = _range(args.turn_tokens, "--turn-tokens")
    preset = args.preset if args.layout is None else None
    spec = WorkloadSpec.for_layout(layout, preset, **overrides)
    if args.requests is not None and args.sessions is None:
        # Distinct requests when possible; past the default size they repeat (the store stays
        # small).
        spec = WorkloadSpec.for_layout(
            layout, preset, **{**overrides, "sessions": min(args.requests, spec.sessions)}
        )
    progress = args.progress if args.progress is not None else stderr.isatty()
    return LoadgenConfig(
        layout=layout,
        layout_source=source,
        spec=spec,
        requests=args.requests,
        duration=args.duration,
        concurrency=concurrency,
        compare=args.compare,
        master=args.master,
        metadata=args.metadata,
        write=args.write,
        local_hostname=args.local_hostname,
        progress=progress,
        timeout=args.timeout,
        threads=args.threads,
        max_keys_per_rpc=args.max_keys_per_rpc,
        max_rpcs_in_flight=args.max_rpcs_in_flight,
        cache_ttl=args.cache_ttl or None,
        rounds=args.rounds,
        linger=args.linger,
    )


def _run_coroutine(coro: Coroutine[Any, Any, _T], loop: str) -> tuple[_T, str]:
    """Run on uvloop (``auto`` when installed, or ``uvloop``), else on asyncio."""
    if loop != "asyncio":
        try:
            import uvloop
        except ImportError:
            pass
        else:
            return uvloop.run(coro), "uvloop"
    return asyncio.run(coro), "asyncio"


@contextlib.contextmanager
def _quiet_fd2(log_path: str | None) -> Iterator[tuple[TextIO, str]]:
    """Send fd 2 (the Mooncake C++ client's glog output) to a log file while the run lasts.

    Yields the stream for our own messages (the real stderr) and the log file's path.
    """
    if log_path is None:
        fd, path = tempfile.mkstemp(prefix="aio-mclookup-mooncake-", suffix=".log")
    else:
        path = log_path
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        real_fd2 = sys.stderr.fileno() == 2
    except (AttributeError, OSError, ValueError):
        real_fd2 = False
    err: TextIO = (
        os.fdopen(os.dup(saved), "w", buffering=1, encoding="utf-8", errors="replace")
        if real_fd2
        else sys.stderr
    )
    os.dup2(fd, 2)
    os.close(fd)
    try:
        yield err, path
    finally:
        with contextlib.suppress(OSError, ValueError):
            err.flush()
        os.dup2(saved, 2)
        os.close(saved)
        if err is not sys.stderr:
            err.close()


def _loadgen(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from ._loadgen.run import LEFT_OPEN

    code = _loadgen_run(args, parser)
    if LEFT_OPEN:  # in-process etcd:// clients: their close, or their destructor at exit,
        sys.stdout.flush()  # would hold the GIL ~30 s each (see closes_holding_the_gil)
        sys.stderr.flush()
        os._exit(code)
    return code


def _loadgen_run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from ._loadgen.report import format_summary, report_unavailable, write_json, write_png
    from ._loadgen.run import run_loadgen
    from ._store.pool import MOONCAKE_INSTALL

    try:
        import mooncake.store  # noqa: F401
    except ImportError:
        parser.error(
            f"the Mooncake client is not installed: {MOONCAKE_INSTALL}"
        )
    try:
        cfg = _config(args, sys.stderr)
    except InvalidRequest as exc:
        parser.error(str(exc))
    if args.report is not None:  # before the load: a run without its PNG is a wasted run
        problem = report_unavailable(args.report)
        if problem is not None:
            parser.error(problem)
    if args.loop == "uvloop" and importlib.util.find_spec("uvloop") is None:
        parser.error("--loop uvloop: uvloop is not installed")
    try:
        quiet = _quiet_fd2(args.mooncake_log)
        err, log_path = quiet.__enter__()
    except OSError as exc:
        parser.error(f"--mooncake-log: cannot write {args.mooncake_log}: {exc.strerror}")
    loop_name = "uvloop" if args.loop != "asyncio" else "asyncio"
    try:

        async def go() -> Any:
            return await run_loadgen(cfg, err=err, loop_name=loop_name)

        report, loop_name = _run_coroutine(go(), args.loop)
    except KeyboardInterrupt:
        err.write("interrupted before anything was measured\n")
        return 130
    finally:
        quiet.__exit__(None, None, None)
    report.loop_name = loop_name
    if report.failure and os.path.getsize(log_path):
        sys.stderr.write(f"the Mooncake client's own log: {log_path}\n")
    elif args.mooncake_log is None:
        with contextlib.suppress(OSError):
            os.unlink(log_path)
    summary_to = sys.stderr if args.json == "-" else sys.stdout
    summary_to.write(format_summary(report) + "\n")
    summary_to.flush()
    if args.json is not None:
        try:
            write_json(report, args.json, sys.stdout)
        except OSError as exc:
            sys.stderr.write(f"aio-mclookup: cannot write {args.json}: {exc}\n")
            return 1
        if args.json != "-":
            sys.stderr.write(f"JSON results written to {args.json}\n")
    if args.report is not None:
        try:
            skipped = write_png(report, args.report)
        except OSError as exc:
            sys.stderr.write(f"aio-mclookup: cannot write {args.report}: {exc}\n")
            return 1
        sys.stderr.write(
            f"report: {skipped}\n" if skipped else f"PNG report written to {args.report}\n"
        )
    if report.interrupted:
        return 130
    if report.failure or report.mismatches:
        return 1
    return 0


def describe(layout: KVLayout, first_hash: bytes) -> str:
    """What ``aio-mclookup layout`` prints for ``layout``."""
    lines = [
        f"vLLM release: {layout.vllm_version}",
        f"model: {layout.model}  cache_prefix: {layout.cache_prefix or '(none)'}",
        f"hash_block_size: {layout.hash_block_size}  scheduler_block_size: "
        f"{layout.scheduler_block_size}  lookup alignment: {layout.lookup_alignment} tokens"
        + ("  (fine-grained: partial hash hits)" if layout.fine_grained else ""),
        "groups:",
    ]
    store_ids = layout.store_group_ids
    for gid, (group, store_id) in enumerate(zip(layout.groups, store_ids)):
        fields = ", ".join(f"{k}={v}" for k, v in group.to_dict().items() if k != "kind")
        where = f"store group {store_id}" if store_id is not None else "not prefix-cacheable"
        lines.append(f"  {gid}: {group.kind} ({fields}): {where}")
    lines.append("spec-groups (the hit search's order):")
    for members, eagle in layout.spec_groups:
        ids = ", ".join(str(m) for m in members)
        lines.append(f"  store groups [{ids}]" + ("  EAGLE" if eagle else ""))
    lines.append("keys of chunk 0, per store group and rank namespace:")
    store_groups = [g for g, s in zip(layout.groups, store_ids) if s is not None]
    for sid, (group, prefixes) in enumerate(zip(store_groups, layout.key_prefixes)):
        index = group.block_size // layout.hash_block_size - 1
        namespaces = layout.group_namespaces[sid]
        lines.append(
            f"  store group {sid}: {len(namespaces)} namespace(s), keyed by "
            f"block_hashes[{index}]"
        )
        for ns, prefix in zip(namespaces, prefixes):
            lines.append(f"    tp={ns[0]} pcp={ns[1]} dcp={ns[2]} pp={ns[3]}: "
                         f"{prefix}@{first_hash.hex()}")
    return "\n".join(lines)


def _layout(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    try:
        first_hash = bytes.fromhex(args.hash)
    except ValueError:
        parser.error(f"--hash must be hex, got {args.hash!r}")
    try:
        with open(args.file, encoding="utf-8") as f:
            cfg = json.load(f)
        layout = KVLayout.from_dict(cfg)
    except OSError as exc:
        parser.error(f"cannot read {args.file}: {exc.strerror}")
    except json.JSONDecodeError as exc:
        parser.error(f"{args.file} is not JSON: {exc}")
    except InvalidRequest as exc:
        parser.error(f"{args.file}: {exc}")
    print(describe(layout, first_hash))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit code."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
        if args.command is None:
            parser.error("choose a command (loadgen, layout, serve); see aio-mclookup --help")
        if args.command == "layout":
            return _layout(args, args.subparser)
        if args.command == "serve":
            return serve(args, args.subparser)
        return _loadgen(args, args.subparser)
    except SystemExit as exc:
        code = exc.code
        if code is None:
            return 0
        return code if isinstance(code, int) else 1
