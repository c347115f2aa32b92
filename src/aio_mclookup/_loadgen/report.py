"""Reporting a load-generator run: the terminal summary, JSON and the PNG."""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable
from typing import Any, TextIO

import numpy as np

from .._layout.layout import KVLayout
from .._layout.sglang import SGLangLayout
from .results import COORDINATOR, NAIVE, LoadgenReport, RunResult
from .workload import describe_hasher, describe_layout, sglang_token_note

__all__ = ["REPORT_NEEDS", "format_summary", "report_unavailable", "write_json", "write_png"]

def format_summary(report: LoadgenReport) -> str:
    """The human summary: setup lines, one table row per run, savings, the hit check."""
    cfg = report.config
    lines: list[str] = []
    lines.append(f"aio-mclookup loadgen  layout: {describe_layout(cfg.layout)}")
    wl = report.workload
    if wl is not None:
        s = wl.summary()
        spec = cfg.spec
        asked = (
            f"every turn from 1 to the current one of {spec.sessions:,} sessions caught at a "
            f"random turn (of up to {spec.turns})"
            if spec.every_turn
            else f"one per chat session caught at a random turn (of up to {spec.turns})"
        )
        lines.append(
            f"workload: {s['requests']:,} distinct requests, {asked}; {spec.system_prompts} "
            f"shared system prompts; {s['warm_sessions']:,} warm sessions whose earlier turns "
            f"are stored (hit ratio {spec.hit_ratio:g}); seed {spec.seed}"
        )
        layout = cfg.layout
        if isinstance(layout, SGLangLayout):
            lines.append(
                f"          prompts {s['prompt_tokens_min']:,}-{s['prompt_tokens_max']:,} "
                f"tokens (mean {s['prompt_tokens_mean']:,.0f}); each lookup counts SGLang "
                f"{layout.sglang_version}'s L3 hit: the first num_tokens - 1 tokens in whole "
                f"{layout.page_size}-token pages, every querying rank's first missing page, the "
                f"minimum over ranks, none below {layout.prefetch_threshold} tokens"
            )
        else:
            lines.append(_vllm_counts(layout, s))
    st = report.store
    if st:
        where = f"{st.get('kind', '?')} {st.get('master', '')}".strip()
        written = st.get("keys_written")
        fill = f", {written:,} keys written in {st.get('fill_s', 0):.1f} s" if written else ""
        lines.append(f"store: {where}{fill}")
    per_run = (
        f"{cfg.requests:,} lookups per run"
        if cfg.requests is not None
        else f"{cfg.duration:g} s per run"
        if cfg.duration is not None
        else "each request once per run"
    )
    if wl is not None and cfg.requests is not None and cfg.requests > len(wl.requests):
        per_run += f" (the {len(wl.requests):,} distinct requests repeat)"
    elif wl is not None and cfg.duration is not None:
        per_run += f" (cycling over the {len(wl.requests):,} distinct requests)"
    lines.append(f"runs: {per_run}; event loop {report.loop_name}; {os.cpu_count()} CPUs")
    if cfg.spec.token_ids and isinstance(cfg.layout, SGLangLayout):
        lines.append(f"token ids: {sglang_token_note(cfg.layout)}")
    elif cfg.spec.token_ids:
        lines.append(
            f"token ids: each lookup, both ways, first hashed its prompt's token ids with "
            f"{describe_hasher(cfg.layout)}; that hashing is included in the latencies and "
            "lookups/s below"
        )
    lines.append("")
    header = (
        f"{'mode':<11} {'conc':>5} {'lookups':>8} {'errors':>6} {'lookups/s':>10} "
        f"{'p50 ms':>7} {'p95 ms':>7} {'p99 ms':>7} {'RPCs/lookup':>11} {'keys/lookup':>11} "
        f"{'hit/prompt tokens':>17}"
    )
    if report.runs:
        lines.append(header)
        lines.append("-" * len(header))
    else:
        lines.append("nothing was measured")
    for run in report.runs:
        n = run.lookups
        ratio = f"{run.hit_tokens / run.prompt_tokens:.1%}" if run.prompt_tokens else "-"
        lines.append(
            f"{run.mode:<11} {run.concurrency:>5} {n:>8,} {run.error_count:>6} "
            f"{run.rate():>10,.0f} {_ms(run.percentile_ms(50))} {_ms(run.percentile_ms(95))} "
            f"{_ms(run.percentile_ms(99))} {_per(run.rpcs, n, 11, 3)} "
            f"{_per(run.keys_sent, n, 11, 1)} "
            f"{ratio:>17}" + ("  (interrupted)" if run.interrupted else "")
        )
    hashed = [r for r in report.runs if r.hash_times or r.hashed_in_lookup]
    if hashed:
        lines.append("")
        lines.append("hashing token ids (included above), per run:")
        for run in hashed:
            if run.hashed_in_lookup:
                lines.append(f"  {run.mode:<11} c={run.concurrency:<4} inside lookup_tokens (on "
                             "the coordinator's worker thread while other lookups are under "
                             "way, else inline), not timed apart")
                continue
            total = sum(run.hash_times)
            lines.append(
                f"  {run.mode:<11} c={run.concurrency:<4} {total:.2f} s in all, "
                f"{run.hash_ms_median():.3f} ms per lookup (median), "
                f"{total / run.elapsed:.0%} of the run's wall time"
                if run.elapsed > 0
                else f"  {run.mode:<11} c={run.concurrency:<4} {total:.2f} s in all"
            )
    savings = _savings(report)
    if savings:
        lines.append("")
        lines.extend(savings)
    lines.append("")
    if report.compared:
        what = (
            "coordinator and seed-naive runs"
            if cfg.compare and any(r.mode == NAIVE for r in report.runs)
            else "all runs"
        )
        if report.mismatches:
            lines.append(
                f"hits: MISMATCH in {report.mismatches:,} of {report.compared:,} compared lookups "
                f"across {what}; first: {report.mismatch_examples[:2]}"
            )
        else:
            lines.append(
                f"hits: identical across {what} ({report.compared:,} lookups compared "
                "request by request)"
            )
    elif report.runs:
        lines.append("hits: nothing to compare (one run only)")
    if report.interrupted:
        lines.append("interrupted: the table shows what was measured before Ctrl-C")
    if report.failure:
        lines.append(f"FAILED: {report.failure}")
    lines.append(f"wall time: {report.wall_seconds:.1f} s")
    return "\n".join(lines)


def _ms(value: float) -> str:
    return f"{'-':>7}" if math.isnan(value) else f"{value:>7.2f}"


def _per(total: int, n: int, width: int, digits: int) -> str:
    return f"{'-':>{width}}" if not n else f"{total / n:>{width}.{digits}f}"


def _savings(report: LoadgenReport) -> list[str]:
    out: list[str] = []
    by_key = {(r.mode, r.concurrency): r for r in report.runs}
    for conc in report.config.concurrency:
        co, na = by_key.get((COORDINATOR, conc)), by_key.get((NAIVE, conc))
        if co is None or na is None or not co.lookups or not na.lookups or not na.rate():
            continue
        out.append(
            f"saving at concurrency {conc}: {co.rate() / na.rate():.1f}x lookups/s, "
            f"{co.rpcs / co.lookups:.3f} vs {na.rpcs / na.lookups:.3f} RPCs/lookup, "
            f"{co.keys_sent / co.lookups:.1f} vs {na.keys_sent / na.lookups:.1f} keys/lookup, "
            f"p50 {co.percentile_ms(50):.2f} vs {na.percentile_ms(50):.2f} ms"
        )
    coord = [r for r in report.runs if r.mode == COORDINATOR and r.lookups]
    planned = sum(r.keys_planned for r in coord)
    if planned:
        n = sum(r.lookups + r.error_count for r in coord)
        sent = sum(r.keys_sent for r in coord)
        cached = sum(r.cache_hits for r in coord)
        shared = sum(r.dedup_hits for r in coord)
        skipped = max(planned - sent - cached - shared, 0)
        ttl = report.config.cache_ttl
        cache = f"{cached / planned:.0%} answered by the {ttl:g} s positive cache" if ttl else ""
        sglang = isinstance(report.config.layout, SGLangLayout)
        sends = "every key of the plan, once" if sglang else "what vLLM sends"
        out.append(
            f"coordinator keys per lookup: {planned / n:.1f} planned ({sends}) -> "
            f"{sent / n:.1f} sent; of the planned keys {skipped / planned:.0%} were skipped by "
            f"probing in rounds, {shared / planned:.0%} shared with concurrent lookups"
            + (f", {cache}" if cache else "")
        )
    return out


def _vllm_counts(layout: KVLayout, s: dict[str, Any]) -> str:
    """The summary's line on prompt sizes and what a vLLM lookup counts."""
    if layout.vllm_version == "0.26.0":
        how = (
            f"the aligned length (floored to the {layout.scheduler_block_size}-token "
            "scheduler block), one token left to compute, as vLLM 0.26's scheduler does"
        )
    else:
        how = (
            f"num_tokens as vLLM {layout.vllm_version}'s scheduler sends it (the worker "
            f"aligns to {layout.lookup_alignment} tokens and leaves one token)"
        )
    return (
        f"          prompts {s['prompt_tokens_min']:,}-{s['prompt_tokens_max']:,} tokens "
        f"(mean {s['prompt_tokens_mean']:,.0f}); each lookup counts what vLLM's "
        f"scheduler does: {how}"
    )


def write_json(report: LoadgenReport, target: str, stdout: TextIO) -> None:
    """The report as JSON to a file, or to ``stdout`` for ``-``."""
    text = json.dumps(report.to_dict(), indent=2)
    if target == "-":
        stdout.write(text + "\n")
        stdout.flush()
    else:
        with open(target, "w", encoding="utf-8") as f:
            f.write(text + "\n")


REPORT_NEEDS = (
    "--report needs matplotlib, which is not installed: install the 'report' extra "
    "(from a clone: pip install -e '.[report]'), or pip install 'matplotlib>=3.7'"
)


def report_unavailable(path: str) -> str | None:
    """Why :func:`write_png` could not write ``path``, or None: checked before any load runs."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return REPORT_NEEDS
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        return f"--report: the directory {parent} does not exist"
    if not os.access(parent, os.W_OK):
        return f"--report: cannot write in {parent}"
    return None


MODE_COLOURS = {COORDINATOR: "black", NAIVE: "tab:red"}
"""Panels 2 and 3: a colour is a way of looking up (panel 1's colours, from viridis, are the
concurrency levels: no colour means two things)."""


def _log_ticks(axis: Any, low: float, high: float) -> None:
    """Readable major ticks on a log axis over [low, high]: under a decade, a few evenly spaced
    plain numbers (matplotlib would label the minor ticks, and they overlap); up to 2.5 decades
    1-2-5; wider, the powers of ten. Plain numbers, no minor-tick labels."""
    from matplotlib.ticker import FuncFormatter, LogLocator, MaxNLocator, NullFormatter

    decades = float(np.log10(max(high, 1e-12) / max(low, 1e-12)))
    locator: Any
    if decades < 1.0:
        locator = MaxNLocator(nbins=4, steps=[1, 2, 2.5, 5, 10])
    else:
        subs = (1.0, 2.0, 5.0) if decades < 2.5 else (1.0,)
        locator = LogLocator(base=10, subs=subs, numticks=12)
    axis.set_major_locator(locator)
    axis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:.3g}"))
    axis.set_minor_formatter(NullFormatter())


def write_png(report: LoadgenReport, path: str) -> str | None:
    """Three panels: the latency distribution of every run, throughput against concurrency, and
    RPCs and keys per lookup against concurrency (what explains the speed-up). Returns why it
    was skipped (None when written)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return REPORT_NEEDS + "; no PNG written"
    runs = [r for r in report.runs if r.lookups]
    if not runs:
        return "nothing was measured; no PNG written"
    fig, (ax_lat, ax_tput, ax_work) = plt.subplots(1, 3, figsize=(19, 6.2))
    levels = sorted({r.concurrency for r in runs})
    colours = plt.get_cmap("viridis")(np.linspace(0.0, 0.85, max(len(levels), 1)))
    for run in sorted(runs, key=lambda r: (r.concurrency, r.mode != COORDINATOR)):
        lat = np.sort(np.asarray(run.latencies)) * 1e3
        frac = np.arange(1, lat.size + 1) / lat.size
        style = "-" if run.mode == COORDINATOR else "--"
        colour = colours[levels.index(run.concurrency)]
        ax_lat.plot(lat, frac, style, color=colour, label=f"{run.mode} c={run.concurrency}")
    ax_lat.set_xscale("log")
    ax_lat.set_ylim(0.0, 1.02)
    ax_lat.set_xlabel("lookup latency (ms, log scale)")
    ax_lat.set_ylabel("fraction of lookups <= latency")
    ax_lat.set_title("Latency CDF per run (solid: coordinator, dashed: seed-naive)", fontsize=10)
    ax_lat.grid(True, which="both", alpha=0.3)
    # Below the axes, so that no curve (the concurrency-1 ones rise at the far left) is hidden.
    ax_lat.legend(
        fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.13), ncol=2, frameon=False
    )

    def per_level(mode: str, value: Callable[[RunResult], float]) -> tuple[list[int], list[float]]:
        pts = sorted((r.concurrency, value(r)) for r in runs if r.mode == mode)
        return [c for c, _ in pts], [v for _, v in pts]

    for mode, marker, style in ((COORDINATOR, "o", "-"), (NAIVE, "s", "--")):
        xs, ys = per_level(mode, RunResult.rate)
        if xs:
            ax_tput.plot(xs, ys, style, marker=marker, color=MODE_COLOURS[mode], label=mode)
    ax_tput.set_ylabel("lookups / s")
    ax_tput.set_title("Throughput against concurrency", fontsize=10)
    ax_tput.set_ylim(bottom=0)
    for mode, style in ((COORDINATOR, "-"), (NAIVE, "--")):
        xs, rpcs = per_level(mode, lambda r: r.rpcs / r.lookups)
        if not xs:
            continue
        _, keys = per_level(mode, lambda r: r.keys_sent / r.lookups)
        colour = MODE_COLOURS[mode]  # the mode's colour; the marker says which quantity
        ax_work.plot(xs, keys, style, marker="s", color=colour, label=f"keys, {mode}")
        ax_work.plot(xs, rpcs, style, marker="o", mfc="white", color=colour,
                     label=f"RPCs, {mode}")
        # The coordinator's labels below its points, the seed-naive ones above: the coordinator
        # sends fewer keys (and, under load, fewer RPCs), so the labels stay apart.
        offset = (4, -11) if mode == COORDINATOR else (4, 5)
        note: dict[str, Any] = {"xytext": offset, "textcoords": "offset points", "fontsize": 7}
        for values, fmt in ((keys, "{:.0f}"), (rpcs, "{:.2f}")):
            for x, y in zip(xs, values):
                ax_work.annotate(fmt.format(y), (x, y), color=colour, **note)
    ax_work.set_yscale("log")
    ax_work.set_ylabel("per lookup (log scale)")
    ax_work.set_title(
        "Store work per lookup: batch_is_exist RPCs and keys sent\n"
        + (
            "(seed-naive: 1 RPC per querying rank, with its keys)"
            if isinstance(report.config.layout, SGLangLayout)
            else "(seed-naive: 1 RPC with every planned key)"
        ),
        fontsize=10,
    )
    for ax in (ax_tput, ax_work):
        ax.set_xscale("log", base=2)
        ax.set_xticks(levels, [str(c) for c in levels])
        ax.minorticks_off()
        ax.set_xlabel("concurrent callers (log scale)")
        ax.margins(x=0.1)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(
            fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.13), ncol=2, frameon=False
        )
    all_latencies = np.concatenate([np.asarray(r.latencies) for r in runs]) * 1e3
    positive = all_latencies[all_latencies > 0]
    if positive.size:
        _log_ticks(ax_lat.xaxis, float(positive.min()), float(positive.max()))
    work = [v for r in runs for v in (r.rpcs / r.lookups, r.keys_sent / r.lookups) if v > 0]
    if work:
        _log_ticks(ax_work.yaxis, min(work), max(work))
    cfg = report.config
    fig.suptitle(
        f"aio-mclookup loadgen: {_model(cfg.layout)} ({cfg.layout_source}), "
        f"{os.cpu_count()} CPUs, {report.loop_name}",
        fontsize=11,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return None


def _model(layout: KVLayout | SGLangLayout) -> str:
    if isinstance(layout, SGLangLayout):
        return f"{layout.model_name or '(no model name)'} (SGLang {layout.sglang_version})"
    return layout.model
