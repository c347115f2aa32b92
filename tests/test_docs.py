"""The docs' code works as written: README.md and docs/*.md, checked so that they cannot drift.

Conventions, for whoever writes a page:

* **```python blocks are executed**, in page order, in one namespace per page: a block may use
  what an earlier block of its page defined. Errors point at the page and line (the code is
  compiled with the page as its file name and its own line numbers).
* **A running master.** When a page's code uses ``master`` or ``metadata`` without defining
  them, they are the addresses of the suite's loopback Mooncake master (``local_master`` in
  tests/conftest.py: ``master_address`` and ``metadata_server``).
* **Top-level ``await``** is allowed: such a block runs in an event loop (as in
  ``python -m asyncio``).
* **``main``.** A page that defines a coroutine function ``main`` and never runs it gets it run
  (``asyncio.run``, bounded), its parameters filled by name from the page's namespace (so
  ``async def main(master: str, metadata: str)`` runs against the suite's master).
* **Printed values.** A ``print(...)`` whose line ends in a comment must print the start of
  that comment: ``print(len(plan.keys))   # 6: three chunks`` must print ``6``.
* **Answers are checked against vLLM.** Every ``LookupCoordinator.lookup`` /
  ``lookup_result`` a page makes is compared with the literal reference port of the layout's
  release (``aio_mclookup._reference``) on the store's answers: ``lookup`` must give vLLM's
  scheduler's count, ``lookup_result`` the worker's reply. And a documented print of a call
  ``print(await f(num_tokens, ...))  # 1152`` that makes a lookup must print vLLM's scheduler's
  count for a request of ``num_tokens`` tokens (with the hashes and layout of that lookup): a
  recipe that computes something else fails, whatever its comment says. Likewise a page's own
  ``layout.plan(n, hashes)``: its keys and every ``resolve`` / ``resolve_result`` of it are
  compared with the reference port's on the same answers.
* **``<!-- not-run: reason -->``** on the line right before a fence skips that block (a
  signature with its defaults, a fragment). Use it sparingly: a block that cannot run is a
  block a reader cannot copy.
* **```bash commands are checked**, each against what it names, without side effects beyond a
  short local run: ``aio-mclookup ...``, ``python -m aio_mclookup ...`` and ``bash run.sh
  loadgen ...`` are parsed and validated by the command's own parser (and ``--help`` is run;
  ``serve``'s settings are checked as the command checks them, nothing started);
  ``bash run.sh test|bench|setup|vllm-env`` must be a sub-command of run.sh (never run here);
  ``python path.py`` is run (bounded); ``pip install``/``pip wheel`` must name this clone
  (``.``, with extras pyproject defines) or a wheel ``pip wheel`` builds (aio-mclookup is not
  on PyPI); ``apt-get install`` may name only packages run.sh installs; ``uvicorn MOD:APP
  --app-dir DIR`` must name a module defining ``APP``; ``source .venv/bin/activate`` must exist.
  Anything else fails until it gets a check here. Inline ``pip install ...`` code spans are
  checked like commands.
"""

from __future__ import annotations

import ast
import asyncio
import builtins
import contextlib
import dataclasses
import inspect
import io
import os
import re
import shlex
import subprocess
import sys
import tokenize
import traceback
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - the suite runs on 3.11
    tomllib = pytest.importorskip("tomli")

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
EXTRAS = set(PYPROJECT["project"]["optional-dependencies"])
VERSION = PYPROJECT["project"]["version"]
BIN = Path(sys.executable).parent  # the virtualenv's programs

_FENCE = re.compile(r"^(\s*)```\s*([\w+-]*)\s*$")
_NOT_RUN = re.compile(r"^\s*<!--\s*not-run:\s*(.*?)\s*-->\s*$")
_INLINE_PIP = re.compile(r"`(pip (?:install|wheel) [^`]+)`")


# Snippets that do not work yet, on pages that other people own: "python PAGE" or
# "bash PAGE ARGV" -> why. Each is an xfail(strict=True): once its page is fixed, the test
# passes, and the strict xfail fails until the entry is removed from here.
PENDING: dict[str, str] = {}
"""Snippets known to fail, by page, with the reason (each must fail, or its entry goes)."""


def _pending(key: str) -> list[Any]:
    reason = PENDING.get(key)
    return [pytest.mark.xfail(strict=True, reason=reason)] if reason else []


@dataclass
class Block:
    page: Path
    lang: str
    line: int  # 1-based line of the first code line
    code: str
    not_run: str | None  # the reason, when marked

    @property
    def where(self) -> str:
        return f"{_rel(self.page)}:{self.line}"


def blocks(page: Path) -> list[Block]:
    """The fenced code blocks of a page, with their line numbers and not-run markers."""
    lines = page.read_text().splitlines()
    out: list[Block] = []
    i = 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, lang = m.group(1), m.group(2)
        j = i + 1
        while j < len(lines) and not lines[j].strip().startswith("```"):
            j += 1
        assert j < len(lines), f"{page.relative_to(ROOT)}:{i + 1}: unclosed code fence"
        prev = next((lines[k] for k in range(i - 1, -1, -1) if lines[k].strip()), "")
        marker = _NOT_RUN.match(prev)
        body = [
            line[len(indent) :] if line.startswith(indent) else line for line in lines[i + 1 : j]
        ]
        out.append(
            Block(page, lang, i + 2, "\n".join(body) + "\n", marker.group(1) if marker else None)
        )
        i = j + 1
    return out


def _rel(page: Path) -> str:
    return str(page.relative_to(ROOT)) if page.is_relative_to(ROOT) else str(page)


# ------------------------------------------------------------------------------ the markers
def test_not_run_markers_give_a_reason_and_precede_a_block() -> None:
    for page in PAGES:
        marked = {b.line - 1 for b in blocks(page) if b.not_run is not None}
        for b in blocks(page):
            if b.not_run is not None:
                assert b.not_run, f"{b.where}: <!-- not-run: --> needs a reason"
        lines = page.read_text().splitlines()
        for n, line in enumerate(lines, 1):
            if _NOT_RUN.match(line):
                fence = next(k for k in range(n, len(lines)) if lines[k].strip())
                assert fence + 1 in marked, f"{_rel(page)}:{n}: not-run marker before no block"


def test_pending_entries_name_existing_snippets() -> None:
    keys = {f"python {_rel(p)}" for p in PAGES}
    keys |= {f"bash {c.where.partition(':')[0]} {' '.join(c.argv)}" for c in commands()}
    stale = set(PENDING) - keys
    assert not stale, f"PENDING entries for snippets that are gone (remove them): {stale}"


def test_the_pages_have_code_to_check() -> None:
    python = [b for p in PAGES for b in blocks(p) if b.lang == "python" and b.not_run is None]
    bash = [b for p in PAGES for b in blocks(p) if b.lang == "bash"]
    assert len(python) >= 5 and len(bash) >= 5  # the extractor finds the blocks


# --------------------------------------------------------------------------- python blocks
def _python_pages() -> list[Any]:
    params = []
    for page in PAGES:
        runnable = [b for b in blocks(page) if b.lang == "python" and b.not_run is None]
        if runnable:
            text = "".join(b.code for b in runnable)
            slow = "LocalMaster" in text or re.search(r"\b(master|metadata)\b", text)
            marks = [pytest.mark.integration] if slow else []
            marks += _pending(f"python {_rel(page)}")
            params.append(pytest.param(page, id=_rel(page), marks=marks))
    return params


def _free_master_names(trees: list[ast.Module]) -> set[str]:
    """``master``/``metadata`` used (or asked for by ``main``) and never defined at top level."""
    used: set[str] = set()
    stored: set[str] = set()
    for tree in trees:
        for node in ast.walk(tree):
            if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load):
                used.add(node.id)
            if isinstance(node, ast.AsyncFunctionDef) and node.name == "main":
                used.update(a.arg for a in node.args.args + node.args.kwonlyargs)
        for node in tree.body:
            for target in [*getattr(node, "targets", []), getattr(node, "target", None)]:
                for name in ast.walk(target) if target is not None else []:
                    if isinstance(name, ast.Name):
                        stored.add(name.id)
    return ({"master", "metadata"} & used) - stored


def _print_comments(block: Block, tree: ast.Module) -> dict[tuple[int, int], str]:
    """``(first line, last line)`` of each ``print(...)`` whose last line ends in a comment."""
    comments: dict[int, str] = {}
    lines = io.StringIO("\n" * (block.line - 1) + block.code).readline
    for tok in tokenize.generate_tokens(lines):
        if tok.type == tokenize.COMMENT:
            comments[tok.start[0]] = tok.string.lstrip("#").strip()
    return {span: comments[span[1]] for span in _prints(tree) if span[1] in comments}


def _prints(tree: ast.Module) -> dict[tuple[int, int], ast.Call]:
    """``(first line, last line)`` of each ``print(...)`` call -> the call."""
    return {
        (node.lineno, node.end_lineno or node.lineno): node
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id == "print"
    }


async def vllm_answer(
    layout: Any, store: Any, num_tokens: int, hashes: Any, *, worker: bool = False
) -> Any:
    """The oracle: vLLM's answer for a request of ``num_tokens`` tokens, by the literal
    reference port of the layout's release on the store's answers. ``worker``: the worker's
    reply (a result with ``hit_length``) for the length the scheduler sends it; else the
    scheduler's count (an int)."""
    from aio_mclookup._reference.v026 import BaselineLookup
    from aio_mclookup._reference.v033 import BaselineLookupV033

    async def exists(keys: list[str] | list[bytes]) -> list[int]:
        out: list[int] = []
        for start in range(0, len(keys), 1000):
            out += await store.batch_is_exist(keys[start : start + 1000])
        return out

    from aio_mclookup import SGLangLayout

    if isinstance(layout, SGLangLayout):  # (no vLLM port: the plan over every key, as
        # SGLang's ranks ask; check_sglang.py checks that rule against SGLang's own code)
        plan = layout.plan(num_tokens, hashes)
        hit = plan.resolve(await exists(plan.keys)) if plan.keys else 0
        return types.SimpleNamespace(hit_length=hit, tail_key_boundaries=()) if worker else hit
    rows = [bytes(h) for h in hashes]
    config = {k: v for k, v in layout.to_dict().items() if k != "hash_bytes"}  # (checked)

    if layout.vllm_version == "0.26.0":  # the scheduler aligns, the worker looks up, then -1
        ref26 = BaselineLookup(config)
        block = layout.scheduler_block_size
        token_len = max(num_tokens, 0) // block * block
        keys, meta = ref26.build_keys(token_len, rows)
        hit = ref26.resolve(token_len, rows, meta, await exists(keys)) if keys else 0
        if worker:
            return types.SimpleNamespace(hit_length=hit, tail_key_boundaries=())
        return max(0, (num_tokens - 1) // block * block) if hit == num_tokens else hit
    ref = BaselineLookupV033(config)  # 0.32+: the worker aligns and leaves a token itself
    keys, meta = ref.build_keys(num_tokens, rows)
    result = ref.resolve(num_tokens, rows, meta, await exists(keys)) if keys else None
    if worker:
        return result if result is not None else types.SimpleNamespace(
            hit_length=0, tail_key_boundaries=()
        )
    return 0 if result is None else result.hit_length


@dataclass
class _Oracle:
    """Checks a page's lookups while it runs (see the module docstring)."""

    filename: str
    prints: dict[tuple[int, int], ast.expr]  # documented prints -> their first call argument
    expected: dict[tuple[int, int], list[int]] = field(default_factory=dict)
    answered: list[tuple[int, str, int]] = field(default_factory=list)
    checked: int = 0

    def printed(self, line: int, out: str) -> None:
        """A print ran: if lookups ran for it, vLLM's answer of the last is what it must say."""
        for span in self.prints:
            if span[0] <= line <= span[1] and self.expected.get(span):
                self.answered.append((span[0], out, self.expected.pop(span)[-1]))

    def _documented(self) -> list[tuple[tuple[int, int], Any]]:
        """The documented prints the current lookup runs under, with their frame."""
        out = []
        frame = sys._getframe(2)
        while frame is not None:
            if frame.f_code.co_filename == self.filename:
                for span in self.prints:
                    if span[0] <= frame.f_lineno <= span[1]:
                        out.append((span, frame))
            frame = frame.f_back
        return out

    @contextlib.contextmanager
    def patched(self) -> Iterator[None]:
        from aio_mclookup._coordinator.shell import LookupCoordinator

        lookup, lookup_result = LookupCoordinator.lookup, LookupCoordinator.lookup_result
        oracle = self

        async def check(coord: Any, call: Any, n: Any, hashes: Any, kw: Any, worker: bool) -> Any:
            documented = oracle._documented()
            got = await call(coord, n, hashes, **kw)
            layout = kw.get("layout") or coord.layout
            want = await vllm_answer(layout, coord.store, n, hashes, worker=worker)
            if worker:
                assert (got.hit_length, tuple(got.tail_key_boundaries)) == (
                    want.hit_length,
                    tuple(want.tail_key_boundaries),
                ), f"{oracle.filename}: lookup_result({n}, ...) gave {got}, vLLM {want}"
            else:
                assert got == want, f"{oracle.filename}: lookup({n}, ...) gave {got}, vLLM {want}"
            oracle.checked += 1
            for span, frame in documented:
                expr = ast.Expression(oracle.prints[span])
                code = compile(expr, oracle.filename, "eval")
                asked = eval(code, frame.f_globals, frame.f_locals)
                answer = await vllm_answer(layout, coord.store, asked, hashes)
                oracle.expected.setdefault(span, []).append(answer)
            return got

        async def checked_lookup(self: Any, n: Any, hashes: Any, **kw: Any) -> Any:
            return await check(self, lookup, n, hashes, kw, False)

        async def checked_result(self: Any, n: Any, hashes: Any, **kw: Any) -> Any:
            return await check(self, lookup_result, n, hashes, kw, True)

        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(LookupCoordinator, "lookup", checked_lookup)
            mp.setattr(LookupCoordinator, "lookup_request", checked_lookup)
            mp.setattr(LookupCoordinator, "lookup_result", checked_result)
            self._patch_plans(mp)
            yield

    def _patch_plans(self, mp: pytest.MonkeyPatch) -> None:
        """A page's own ``layout.plan(n, hashes)``: its keys, and every ``resolve`` /
        ``resolve_result`` of it, are compared with the reference port's on the same answers."""
        from aio_mclookup._layout.layout import KVLayout
        from aio_mclookup._plan.era_c import EraCPlan
        from aio_mclookup._plan.plan import LookupPlan

        oracle, plans = self, {}
        plan = KVLayout.plan

        def from_page() -> bool:
            return sys._getframe(2).f_code.co_filename == oracle.filename

        def recording_plan(layout: Any, n: Any, hashes: Any) -> Any:
            made = plan(layout, n, hashes)
            if from_page():
                plans[id(made)] = (made, layout, n, hashes)
            return made

        def checked(cls: type, name: str) -> Any:
            original = getattr(cls, name)

            def method(made: Any, answers: Any) -> Any:
                got = original(made, answers)
                entry = plans.get(id(made))
                if entry is not None and entry[0] is made and from_page():
                    oracle._check_plan(*entry[1:], answers, got, name == "resolve")
                return got

            return method

        mp.setattr(KVLayout, "plan", recording_plan)
        for cls in (LookupPlan, EraCPlan):
            for name in ("resolve", "resolve_result"):
                if name in cls.__dict__:
                    mp.setattr(cls, name, checked(cls, name))

    def _check_plan(
        self, layout: Any, n: int, hashes: Any, answers: Any, got: Any, bare: bool
    ) -> None:
        from aio_mclookup._reference.v026 import BaselineLookup
        from aio_mclookup._reference.v033 import BaselineLookupV033

        config = {k: v for k, v in layout.to_dict().items() if k != "hash_bytes"}
        rows = [bytes(h) for h in hashes]
        old = layout.vllm_version == "0.26.0"
        ref: Any = BaselineLookup(config) if old else BaselineLookupV033(config)
        keys, meta = ref.build_keys(n, rows)
        ours = [k.decode() if isinstance(k, bytes) else k for k in layout.plan(n, hashes).keys]
        assert ours == keys, f"{self.filename}: plan({n}, ...).keys differ from vLLM's"
        if answers is None or not keys:
            want_hit, want_bounds = 0, ()
        else:
            want = ref.resolve(n, rows, meta, list(answers))
            want_hit = want if old else want.hit_length
            want_bounds = () if old else tuple(want.tail_key_boundaries)
        if bare:
            assert got == want_hit, f"{self.filename}: plan.resolve gave {got}, vLLM {want_hit}"
        else:
            pair = (got.hit_length, tuple(got.tail_key_boundaries))
            assert pair == (want_hit, want_bounds), f"{self.filename}: {got}, vLLM {want_hit}"
        self.checked += 1


def _print_calls(tree: ast.Module) -> dict[tuple[int, int], ast.expr]:
    """``(first line, last line)`` of each ``print(f(n, ...))`` / ``print(await f(n, ...))``
    -> the expression ``n``."""
    out = {}
    for span, node in _prints(tree).items():
        arg = node.args[0] if len(node.args) == 1 else None
        if isinstance(arg, ast.Await):
            arg = arg.value
        if isinstance(arg, ast.Call) and arg.args:
            out[span] = arg.args[0]
    return out


def _traceback_in(page: Path, exc: BaseException) -> str:
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if f.filename == _rel(page)]
    where = "".join(f"  {f.filename}:{f.lineno}: {f.line}\n" for f in frames)
    return f"{where}{type(exc).__name__}: {exc}"


@pytest.mark.timeout(180)
@pytest.mark.parametrize("page", _python_pages())
def test_python_blocks_run(page: Path, request: pytest.FixtureRequest) -> None:
    run_python_page(page, lambda: request.getfixturevalue("local_master"))


def run_python_page(page: Path, get_master: Callable[[], Any]) -> None:
    """Run a page's python blocks by the conventions above; fails naming page and line."""
    runnable = [b for b in blocks(page) if b.lang == "python" and b.not_run is None]
    filename = _rel(page)
    codes, trees = [], []
    for b in runnable:
        source = "\n" * (b.line - 1) + b.code
        try:
            trees.append(ast.parse(source, filename))
            flags = ast.PyCF_ALLOW_TOP_LEVEL_AWAIT
            codes.append(compile(source, filename, "exec", flags=flags))
        except SyntaxError as exc:
            pytest.fail(
                f"{filename}:{exc.lineno}: not Python: {exc.msg} (a signature? mark it "
                "<!-- not-run: reason -->)"
            )
    printed: list[tuple[int, str]] = []

    def recording_print(
        *args: Any,
        sep: str | None = " ",
        end: str | None = "\n",
        file: Any = None,
        flush: bool = False,
    ) -> None:
        caller = sys._getframe(1)
        if file is None and caller.f_code.co_filename == filename:
            out = (sep if sep is not None else " ").join(map(str, args))
            printed.append((caller.f_lineno, out))
            oracle.printed(caller.f_lineno, out)
        builtins.print(*args, sep=sep, end=end, file=file, flush=flush)

    module = types.ModuleType(f"docs_{page.stem.replace('-', '_')}")
    ns: dict[str, Any] = module.__dict__
    ns["print"] = recording_print
    ns["__file__"] = str(page)
    wanted = _free_master_names(trees)
    if wanted:
        master = get_master()
        ns.update(master=master.master_address, metadata=master.metadata_server)
    sys.modules[module.__name__] = module  # dataclasses and pickling look modules up
    documented = {}
    for b, tree in zip(runnable, trees, strict=True):
        calls = _print_calls(tree)
        documented.update({span: calls[span] for span in _print_comments(b, tree) if span in calls})
    oracle = _Oracle(filename, documented)
    try:
        with oracle.patched():
            _run_blocks(page, runnable, codes, ns)
    finally:
        sys.modules.pop(module.__name__, None)
    for b, tree in zip(runnable, trees, strict=True):
        for (first, last), comment in _print_comments(b, tree).items():
            outs = [out for line, out in printed if first <= line <= last]
            assert outs, f"{filename}:{first}: this print() never ran (its comment: # {comment})"
            for out in outs:
                ok = comment == out or (
                    comment.startswith(out) and comment[len(out)] in " :;,(" and out != ""
                )
                assert ok, f"{filename}:{first}: printed {out!r}, but the comment says # {comment}"
    for first, out, answer in oracle.answered:  # documented lookup answers: vLLM's
        assert out == str(answer), (
            f"{filename}:{first}: printed {out!r}, but vLLM's scheduler counts {answer} for "
            "that request"
        )


def _run_blocks(page: Path, runnable: list[Block], codes: list[Any], ns: dict[str, Any]) -> None:
    filename = _rel(page)
    for b, code in zip(runnable, codes, strict=True):
        try:
            if code.co_flags & inspect.CO_COROUTINE:  # top-level await
                asyncio.run(asyncio.wait_for(eval(code, ns), 120))
            else:
                exec(code, ns)
        except Exception as exc:
            pytest.fail(f"{b.where}: the block raised\n{_traceback_in(page, exc)}")
    main = ns.get("main")
    text = "".join(b.code for b in runnable)
    if inspect.iscoroutinefunction(main) and not re.search(
        r"(asyncio\.run|await)\s*\(?\s*main\(", text
    ):
        params = inspect.signature(main).parameters
        missing = [p for p in params if p not in ns]
        assert not missing, f"{filename}: main() asks for {missing}, which nothing provides"
        try:
            asyncio.run(asyncio.wait_for(main(**{p: ns[p] for p in params}), 120))
        except Exception as exc:
            pytest.fail(f"{filename}: main() raised\n{_traceback_in(page, exc)}")


# ---------------------------------------------------------------------------- bash commands
@dataclass
class Command:
    where: str
    text: str
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)
    wheel_dir: str | None = None  # where an earlier `pip wheel . -w DIR` of the page writes


def _commands_of(block: Block) -> Iterator[tuple[int, str]]:
    """``(line, command)``: continuation lines joined, one per shell command."""
    pending, start = "", 0
    for n, line in enumerate(block.code.splitlines(), block.line):
        if not pending:
            start = n
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        text = (pending + line).strip()
        pending = ""
        if text and not text.startswith("#"):
            yield start, text


def commands() -> list[Command]:
    out: list[Command] = []
    for page in PAGES:
        wheel_dir: str | None = None
        for b in blocks(page):
            if b.lang not in ("bash", "sh", "shell") or b.not_run is not None:
                continue
            for line, text in _commands_of(b):
                words = shlex.split(text, comments=True)
                current: list[str] = []
                for word in [*words, "&&"]:
                    if word in ("&&", "||", ";", "|"):
                        if current:
                            env = {}
                            while current and re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", current[0]):
                                key, _, value = current.pop(0).partition("=")
                                env[key] = value
                            if current and current[0] == "sudo":
                                current.pop(0)
                            where = f"{_rel(page)}:{line}"
                            out.append(Command(where, text, current, env, wheel_dir))
                            if current[-2:-1] == ["-w"] and "wheel" in current:
                                wheel_dir = current[-1]
                        current = []
                    else:
                        current.append(word)
        for n, line in enumerate(page.read_text().splitlines(), 1):
            for m in _INLINE_PIP.finditer(line):
                out.append(
                    Command(f"{_rel(page)}:{n} (inline)", m.group(1), shlex.split(m.group(1)))
                )
    return out


def _run_sh_commands() -> set[str]:
    text = (ROOT / "run.sh").read_text()
    return set(re.findall(r"^\s{4}([\w-]+)\)\s*$", text, re.MULTILINE))


def run_sh_packages() -> set[str]:
    """The Debian packages run.sh installs (its ``apt-get install`` line and continuation)."""
    text = (ROOT / "run.sh").read_text().replace("\\\n", " ")
    m = re.search(r"apt-get install ([^\n>]*)", text)
    assert m, "run.sh installs no Debian packages?"
    return {w for w in m.group(1).split() if not w.startswith("-")}


def _check_cli(cmd: Command, args: list[str]) -> None:
    from aio_mclookup import _cli

    parser = _cli.build_parser()
    stderr = io.StringIO()
    with contextlib.redirect_stderr(stderr), contextlib.redirect_stdout(io.StringIO()):
        try:
            parsed = parser.parse_args(args)
        except SystemExit as exc:
            if exc.code != 0:  # 0: --help or --version
                pytest.fail(f"{cmd.where}: `{cmd.text}` does not parse: {stderr.getvalue()}")
            parsed = None
    if parsed is not None and getattr(parsed, "command", None) == "loadgen":
        try:
            _cli._config(parsed, io.StringIO())
        except Exception as exc:
            pytest.fail(f"{cmd.where}: `{cmd.text}`: {type(exc).__name__}: {exc}")
    if parsed is not None and getattr(parsed, "command", None) == "serve":
        from aio_mclookup._cli_serve import serve_settings

        try:  # (the settings as the command checks them, over this environment)
            serve_settings(parsed, {**os.environ, **cmd.env})
        except Exception as exc:
            pytest.fail(f"{cmd.where}: `{cmd.text}`: {type(exc).__name__}: {exc}")
    program = BIN / "aio-mclookup"
    assert program.exists(), f"{cmd.where}: {program} is not installed"
    proc = subprocess.run(
        [str(program), *args, "--help"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
        stdin=subprocess.DEVNULL,
    )
    assert proc.returncode == 0 and "usage:" in proc.stdout, f"{cmd.where}: {proc.stderr}"


def _check_venv_program(cmd: Command, program: str) -> str:
    """``.venv/bin/X`` must be the virtualenv run.sh makes; returns ``X``."""
    if "/" in program:
        assert program.startswith(".venv/bin/"), f"{cmd.where}: `{program}`: which virtualenv?"
        assert (ROOT / program).exists() or (BIN / Path(program).name).exists(), (
            f"{cmd.where}: {program} does not exist (bash run.sh setup makes it)"
        )
    return Path(program).name


def _check_pip(cmd: Command, args: list[str]) -> None:
    assert args and args[0] in ("install", "wheel"), f"{cmd.where}: pip {args[:1]}: no check"
    verb, rest = args[0], list(args[1:])
    wheel_dir = None
    specs: list[str] = []
    while rest:
        word = rest.pop(0)
        if word in ("-w", "--wheel-dir"):
            wheel_dir = rest.pop(0)
        elif word in ("-e", "--editable"):
            specs.append(rest.pop(0))
        elif word in ("--no-deps", "-q", "-U", "--upgrade"):
            pass
        else:
            assert not word.startswith("-"), f"{cmd.where}: pip option {word}: no check"
            specs.append(word)
    assert specs, f"{cmd.where}: pip {verb} of nothing"
    for spec in specs:
        m = re.fullmatch(r"(?P<path>[^\[\]]+?)(?:\[(?P<extras>[^\]]*)\])?", spec)
        assert m, f"{cmd.where}: cannot read {spec!r}"
        path, extras = m.group("path"), m.group("extras")
        local = path.startswith((".", "/")) or path.endswith(".whl") or "/" in path
        if local:
            if path.endswith(".whl"):
                name = Path(path).name
                assert name == f"aio_mclookup-{VERSION}-py3-none-any.whl", (
                    f"{cmd.where}: {name}: `pip wheel .` writes "
                    f"aio_mclookup-{VERSION}-py3-none-any.whl"
                )
                built = cmd.wheel_dir
                assert built is not None and Path(path).parent == Path(built), (
                    f"{cmd.where}: {path}: no `pip wheel . -w DIR` before it on this page"
                )
            else:
                assert (ROOT / path).resolve() == ROOT, f"{cmd.where}: {path} is not this clone"
            unknown = {e.strip() for e in (extras or "").split(",") if e.strip()} - EXTRAS
            assert not unknown, f"{cmd.where}: extras {sorted(unknown)} are not in pyproject.toml"
        else:
            from packaging.requirements import Requirement
            from packaging.utils import canonicalize_name

            req = Requirement(spec)
            assert canonicalize_name(req.name) != "aio-mclookup", (
                f"{cmd.where}: `{cmd.text}`: aio-mclookup is not on PyPI; install from the clone "
                "(pip install -e '.[cpu]') or from a wheel built from it"
            )
    if verb == "wheel":
        assert specs == ["."], f"{cmd.where}: pip wheel of {specs}, not of this clone"
        assert wheel_dir, f"{cmd.where}: pip wheel without -w DIR"


def _check_uvicorn(cmd: Command, args: list[str]) -> None:
    app_dir = args[args.index("--app-dir") + 1] if "--app-dir" in args else "."
    target = next(a for a in args if ":" in a and not a.startswith("-"))
    module, _, attr = target.partition(":")
    path = ROOT / app_dir / (module.replace(".", "/") + ".py")
    assert path.exists(), f"{cmd.where}: {path.relative_to(ROOT)} does not exist"
    tree = ast.parse(path.read_text())
    names = {
        t.id
        for n in tree.body
        if isinstance(n, ast.Assign)
        for t in n.targets
        if isinstance(t, ast.Name)
    }
    names |= {
        n.target.id
        for n in tree.body
        if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)
    }
    assert attr in names, f"{cmd.where}: {path.relative_to(ROOT)} defines no {attr}"
    assert (BIN / "uvicorn").exists(), f"{cmd.where}: uvicorn is not installed"


def check_command(cmd: Command) -> None:
    for key, value in cmd.env.items():
        if "/" in value and ":" not in value:
            assert (ROOT / value).exists(), f"{cmd.where}: {key}={value} does not exist"
    program, args = cmd.argv[0], cmd.argv[1:]
    name = _check_venv_program(cmd, program)
    if name == "bash" and args[:1] == ["run.sh"]:
        sub = args[1] if len(args) > 1 else ""
        assert sub in _run_sh_commands(), f"{cmd.where}: run.sh has no command {sub!r}"
        if sub == "loadgen":
            _check_cli(cmd, ["loadgen", *args[2:]])
        # test, bench and setup are not run from the suite (they run it, or install).
    elif name == "aio-mclookup":
        _check_cli(cmd, args)
    elif name in ("python", "python3"):
        if args[:2] == ["-m", "aio_mclookup"]:
            _check_cli(cmd, args[2:])
        elif args[:2] == ["-m", "pip"]:
            _check_pip(cmd, args[2:])
        elif args and args[0].endswith(".py"):
            script = ROOT / args[0]
            assert script.exists(), f"{cmd.where}: {args[0]} does not exist"
            proc = subprocess.run(
                [sys.executable, *args],
                capture_output=True,
                text=True,
                timeout=120,
                cwd=ROOT,
                stdin=subprocess.DEVNULL,
                env={**os.environ, **cmd.env},
            )
            # The Mooncake client's glog lines ("I1201 12:00:00.000 ...") say nothing here.
            glog = re.compile(r"^[IWEF]\d{4} ")
            ours = [line for line in proc.stderr.splitlines() if not glog.match(line)]
            assert proc.returncode == 0, (
                f"{cmd.where}: `{cmd.text}` exited {proc.returncode}\nstdout (tail):\n"
                f"{proc.stdout[-2000:]}\nstderr (tail, without glog lines):\n"
                + "\n".join(ours[-40:])
            )
        else:
            pytest.fail(f"{cmd.where}: `{cmd.text}`: no check for this python command")
    elif name == "pip":
        _check_pip(cmd, args)
    elif name in ("source", "."):
        assert args == [".venv/bin/activate"], f"{cmd.where}: source {args}: which virtualenv?"
        assert (ROOT / args[0]).exists() or (BIN / "activate").exists(), (
            f"{cmd.where}: {args[0]} does not exist (bash run.sh setup makes it)"
        )
    elif name == "apt-get":
        assert args[:1] == ["install"], f"{cmd.where}: apt-get {args[:1]}: no check"
        packages = {a for a in args[1:] if not a.startswith("-")}
        extra = packages - run_sh_packages()
        assert not extra, f"{cmd.where}: run.sh does not install {sorted(extra)}"
    elif name == "uvicorn":
        _check_uvicorn(cmd, args)
    else:
        pytest.fail(f"{cmd.where}: `{cmd.text}`: no check for {program!r}; add one to {__file__}")


def _command_params() -> list[Any]:
    params = []
    for cmd in commands():
        slow = cmd.argv[:1] in (["python"], [".venv/bin/python"]) and cmd.argv[1:2] != ["-m"]
        marks = [pytest.mark.integration] if slow else []
        marks += _pending(f"bash {cmd.where.partition(':')[0]} {' '.join(cmd.argv)}")
        params.append(pytest.param(cmd, id=f"{cmd.where} {cmd.text[:40]}", marks=marks))
    return params


@pytest.mark.timeout(180)
@pytest.mark.parametrize("cmd", _command_params())
def test_commands_work_as_written(cmd: Command) -> None:
    check_command(cmd)


# ------------------------------------------------------------------------- facts in prose
def test_readme_names_every_debian_package_run_sh_installs() -> None:
    readme = (ROOT / "README.md").read_text()
    for package in run_sh_packages():
        assert re.search(rf"\b{re.escape(package)}\b", readme), f"README.md: no {package}"


def test_loadgen_page_states_the_defaults_of_the_code() -> None:
    from aio_mclookup import (
        FakeStore,
        FullAttention,
        KVLayout,
        LookupCoordinator,
        MooncakeStore,
        StoreWriter,
    )
    from aio_mclookup._loadgen.results import LoadgenConfig

    page = (ROOT / "docs" / "loadgen.md").read_text()
    layout = KVLayout([FullAttention(16)], model="m", hash_block_size=16, scheduler_block_size=16)
    options = LookupCoordinator(layout, FakeStore()).options  # the defaults
    loadgen = {f.name: f.default for f in dataclasses.fields(LoadgenConfig)}
    in_flight = options.max_rpcs_in_flight
    assert in_flight == loadgen["max_rpcs_in_flight"]
    m = re.search(r"at most (\d+) RPCs of at most (\d+) keys in flight", page)
    assert m and int(m.group(1)) == in_flight, "docs/loadgen.md: RPCs in flight"
    assert int(m.group(2)) == options.max_keys_per_rpc == loadgen["max_keys_per_rpc"]
    store_timeout = inspect.signature(MooncakeStore).parameters["rpc_timeout"].default
    writer_timeout = inspect.signature(StoreWriter).parameters["rpc_timeout"].default
    m = re.search(r"`MC_RPC_TIMEOUT_MS`, set by the first client[^)]*?: (\d+) s", page)
    assert m and float(m.group(1)) == store_timeout == writer_timeout, "docs/loadgen.md: timeout"
    about = re.search(r"It takes about (\d+) s", page)
    wall = re.search(r"^wall time: ([\d.]+) s$", page, re.MULTILINE)
    assert about and wall, "docs/loadgen.md: run time and sample"
    assert abs(float(about.group(1)) - float(wall.group(1))) <= 0.15 * float(wall.group(1))


# ------------------------------------------------------------------ the harness catches drift
def _page(tmp_path: Path, text: str) -> Path:
    page = tmp_path / "page.md"
    page.write_text(text)
    return page


def _no_master() -> Any:
    raise AssertionError("this page needs no master")


def test_harness_checks_printed_values_against_their_comments(tmp_path: Path) -> None:
    good = "```python\nx = 6\nprint(x)   # 6: six\nprint('a', 'b')  # a b\n```\n"
    run_python_page(_page(tmp_path, good), _no_master)
    bad = "Text.\n\n```python\nx = 7\nprint(x)   # 6: six\n```\n"
    with pytest.raises(AssertionError, match=r"page.md:5: printed '7', but the comment says # 6"):
        run_python_page(_page(tmp_path, bad), _no_master)
    never = "```python\nif False:\n    print(1)  # 1\n```\n"
    with pytest.raises(AssertionError, match=r"page.md:3: this print\(\) never ran"):
        run_python_page(_page(tmp_path, never), _no_master)


def test_harness_runs_main_and_top_level_await_and_points_at_the_line(tmp_path: Path) -> None:
    text = (
        "```python\nimport asyncio\nseen = []\n\nasync def main(master: str) -> None:\n"
        "    seen.append(master)\n    print(len(seen))  # 1\n```\n\n"
        "```python\nawait asyncio.sleep(0)\nprint('awaited')  # awaited\n```\n"
    )
    run_python_page(
        _page(tmp_path, text),
        lambda: types.SimpleNamespace(
            master_address="127.0.0.1:1", metadata_server="http://127.0.0.1:2/metadata"
        ),
    )
    failing = "```python\nx = 1\n```\n\n```python\ny = x\nz = undefined_name\n```\n"
    with pytest.raises(pytest.fail.Exception, match=r"(?s)page.md:6: the block raised.*page.md:7"):
        run_python_page(_page(tmp_path, failing), _no_master)
    marked = "<!-- not-run: a signature -->\n```python\nf(a, *, b=1)\n```\n"
    run_python_page(_page(tmp_path, marked), _no_master)  # skipped, so no SyntaxError
    with pytest.raises(pytest.fail.Exception, match=r"page.md:2: not Python"):
        run_python_page(_page(tmp_path, marked.split("\n", 1)[1]), _no_master)


def test_harness_refuses_commands_that_would_not_work(tmp_path: Path) -> None:
    def check(text: str) -> None:
        page = _page(tmp_path, f"```bash\n{text}\n```\n")
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(sys.modules[__name__], "PAGES", [page])
            found = commands()
        assert found, text
        for cmd in found:
            check_command(cmd)

    for text, message in [
        ("pip install 'aio-mclookup[cpu]'", "aio-mclookup is not on PyPI"),
        ("pip install -e '.[gpu]'", r"extras \['gpu'\] are not in pyproject.toml"),
        ("pip install dist/aio_mclookup-0.1.0-py3-none-any.whl", "no `pip wheel . -w DIR`"),
        ("sudo apt-get install -y libfoo1", r"run.sh does not install \['libfoo1'\]"),
        ("bash run.sh deploy", "run.sh has no command 'deploy'"),
        ("aio-mclookup loadgen --concurrency 0", "--concurrency must be >= 1"),
        ("aio-mclookup loadgen --bogus", "does not parse"),
        ("aio-mclookup serve --layout nope.json --demo", r"nope\.json: cannot read it"),
        ("aio-mclookup serve --layout examples/layouts/single_full_attention.json", "no master"),
        ("python examples/nope.py", "examples/nope.py does not exist"),
        ("uvicorn fastapi_app:nope --app-dir examples", "defines no nope"),
        ("make all", "no check for 'make'"),
    ]:
        with pytest.raises((AssertionError, pytest.fail.Exception), match=message):
            check(text)
    check("pip wheel . -w dist && pip install 'dist/aio_mclookup-0.1.0-py3-none-any.whl[cpu]'")


def test_harness_checks_documented_lookup_answers_against_vllm(tmp_path: Path) -> None:
    """The 0.26 recipe (align, look up, leave one token) on a 0.33 layout is one block low for
    a whole-prefix hit: a page documenting its answer fails, even with a matching comment."""
    head = (
        "```python\nimport aio_mclookup as mcl\n"
        "layout = mcl.KVLayout([mcl.FullAttention(16)], model='m', hash_block_size=16,\n"
        "                      scheduler_block_size=16)\n"
        "hashes = [bytes([i]) * 32 for i in range(72)]\n"
        "store = mcl.FakeStore(layout.plan(1152, hashes).keys)\n\n"
        "async def cached(n, h):\n"
        "    async with mcl.LookupCoordinator(layout, store) as c:\n"
    )
    right = head + "        return await c.lookup(n, h)\n\n"
    right += "print(await cached(1160, hashes))  # 1152\n```\n"
    run_python_page(_page(tmp_path, right), _no_master)
    wrong = head + (
        "        return layout.leave_one_token(await c.lookup(layout.align(n), h), n)\n\n"
        "print(await cached(1160, hashes))  # 1136\n```\n"
    )
    with pytest.raises(AssertionError, match=r"page.md:12: printed .1136., but vLLM.s sched"):
        run_python_page(_page(tmp_path, wrong), _no_master)


def _section(page: str, name: str) -> str:
    return page.split(f"<!-- {name}:start -->")[1].split(f"<!-- {name}:end -->")[0]


def test_benchmarks_summary_states_the_figures_of_its_sections() -> None:
    """The summary table's ratios are those of the tables the scripts wrote (rerunning a
    benchmark changes them: update the summary with it)."""
    page = (ROOT / "docs" / "benchmarks.md").read_text()
    summary = page.split("<!--", 1)[0]
    found = {  # scenario -> (vs seed-naive, vs per-request)
        row.split("|")[1].strip(): re.findall(r"\*\*([\d.]+x)\*\*", row)
        for row in _section(page, "bench_coalesce").splitlines()
        if row.startswith("|") and "| coordinator |" in row
    }
    ratios = {name: both[0] for name, both in found.items()}
    rows = {line.split("|")[1].strip(): line for line in summary.splitlines() if "|" in line}

    def row(start: str) -> str:
        return next(text for name, text in rows.items() if name.startswith(start))

    def pair(name: str) -> str:
        return f"{found[name][0]} / {found[name][1]}"

    chat = row("chat:")
    assert f"**{pair('chat')}".replace(" / ", "** / ") in chat and pair("chat-0.33") in chat
    single = row("the same chat prompts, one caller")
    assert pair("chat-single") in single and pair("chat-single-0.33") in single
    dsv4 = row("DeepSeek-V4-like (4 groups")
    assert all(pair(k) in dsv4 for k in ("dsv4", "dsv4-single", "dsv4-0.33", "dsv4-single-0.33"))
    sessions = row("multi-turn sessions")
    assert all(pair(k) in sessions for k in ("sessions", "sessions-0.33", "sessions-hybrid-0.33"))
    bursts = row("cold bursts")
    assert f"{ratios['chat-burst']} / {ratios['dsv4-burst']}" in bursts
    assert f"{ratios['chat-burst-0.33']} / {ratios['dsv4-burst-0.33']}" in bursts
    sglang = re.findall(r"\*\*([\d.]+x)\*\*", _section(page, "bench_sglang"))
    assert f"{sglang[-2]} / {sglang[-1]}" in row("SGLang HiCache")
    loadgen = _section(page, "bench_loadgen")
    savings = re.findall(r"^saving at concurrency \d+: ([\d.]+x)", loadgen, re.M)
    assert ", ".join(savings) in row("the load generator's default run"), savings
    low, high = min(savings, key=lambda r: float(r[:-1])), max(savings, key=lambda r: float(r[:-1]))
    assert f"shows {low[:-1]}-{high} where the chat row shows {ratios['chat']}" in summary


def test_loadgen_prose_states_the_ratios_of_its_samples() -> None:
    page = (ROOT / "docs" / "loadgen.md").read_text()
    chat = re.findall(r"^saving at concurrency (\d+): ([\d.]+)x", page, re.M)[:4]
    said = ", ".join(f"{r}x (c={c})" for c, r in chat[:3]) + f" and {chat[3][1]}x (c={chat[3][0]})"
    assert said in page.replace("\n  ", " "), said
    dsv4 = page.split("--preset dsv4 -c 1,16,64")[1].split("```text")[1].split("```")[0]
    row = r"^\w[\w-]+ +\d+ +[\d,]+ +\d+ +([\d,]+)"
    rates = [int(m.replace(",", "")) for m in re.findall(row, dsv4, re.M)]
    pairs = [f"{rates[i] / rates[i + 1]:.1f}x" for i in range(0, len(rates), 2)]
    assert f"dsv4 {pairs[0]}, {pairs[1]} and {pairs[2]} (c=1, 16," in page.replace("\n  ", " ")


def test_harness_checks_a_pages_plans_against_the_reference_ports(tmp_path: Path) -> None:
    """A page's plan keys and ``resolve`` answers are compared with vLLM's (the ports): a
    wrong answer fails even when the comment repeats it."""
    from aio_mclookup._plan.era_c import EraCPlan

    page = _page(
        tmp_path,
        "```python\nimport aio_mclookup as mcl\n"
        "layout = mcl.KVLayout([mcl.FullAttention(16)], model='m', hash_block_size=16,\n"
        "                      scheduler_block_size=16)\n"
        "plan = layout.plan(64, [b'h%d' % i for i in range(4)])\n"
        "print(plan.resolve([1, 1, 1, 1]))  # 48\n"
        "print(plan.resolve_result([1, 1, 0, 0]).hit_length)  # 32\n```\n",
    )
    run_python_page(page, _no_master)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(EraCPlan, "resolve", lambda self, answers: 64)  # a wrong hit rule
        wrong = _page(tmp_path, page.read_text().replace("# 48", "# 64"))
        message = r"(?s)page.md:6: .*plan\.resolve gave 64, vLLM 48"
        with pytest.raises(pytest.fail.Exception, match=message):
            run_python_page(wrong, _no_master)
