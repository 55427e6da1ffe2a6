"""Writing results: one JSON file, one Markdown table, one plot.

The JSON holds everything measured (every repetition's time included); the
Markdown is what `docs/benchmarks.md` and `docs/compiler-measurements.md`
quote; the plot shows step time and per-device temp memory against the
microbatch count for every row.
"""

from __future__ import annotations

import json
import os


def mib(n) -> str:
    return "-" if n is None else f"{n / 2**20:.1f}"


def _ms(s) -> str:
    return "-" if s is None else f"{s * 1e3:.1f}"


def _x(r) -> str:
    return "-" if r is None else f"{r:.2f}x"


def _pair(rec: dict, key: str) -> str:
    """``median / best`` of a ratio (see `bench.run.compare`)."""
    median, best = rec.get(key), rec.get("best_" + key)
    if median is None:
        return "-"
    return f"{median:.2f}x" if best is None else f"{median:.2f} / {best:.2f}x"


def _ms_pair(rec: dict) -> str:
    median, best = rec.get("step_seconds"), rec.get("step_min_seconds")
    if median is None:
        return "-"
    return _ms(median) if best is None else f"{_ms(median)} / {_ms(best)}"


def _s(s) -> str:
    return "-" if s is None else f"{s:.2f}"


def _header(meta: dict) -> list[str]:
    w = meta["workload"]
    return [
        f"Command: `{meta['command']}`",
        "",
        f"- workload: {w['description']}",
        f"- devices: {meta['devices']}; host {meta['host']}; jax {meta['jax']}; {meta['date']}",
        f"- timing: {meta['reps']} interleaved rounds after a warm-up "
        f"({min(meta['reps'], meta.get('large_reps', meta['reps']))} for 64 or more microbatches "
        "in the table suite); a step is shown as median / best, a ratio as the median of the "
        "per-round ratios / best over best",
        "",
    ]


def for_docs(markdown: str) -> str:
    """A suite's Markdown as a docs block: no title or command line (the block's
    stamp gives the command), its sections one level under the page's."""
    out = []
    for line in markdown.splitlines():
        if line.startswith("# ") or line.startswith("Command: "):
            continue
        out.append("##" + line if line.startswith("## ") else line)
    return "\n".join(out).strip("\n")


def _profile_lines(profile: dict) -> list[str]:
    if not profile:
        return []
    lines = [
        "## Per-stage costs from the profiler (ms, one microbatch, one device)",
        "",
        "Timed with the rows of the same group.",
        "",
    ]
    for M, by_stages in profile.items():
        for S, costs in by_stages.items():
            lines.append(
                f"- M={M}, {S} stages: "
                + "; ".join(
                    f"{k} " + ", ".join(f"{v * 1e3:.2f}" for v in vs) for k, vs in costs.items()
                )
            )
    lines.append("")
    return lines


# The columns `_timing_cells` fills, shared by both suites' tables.
TIMING_COLUMNS = (
    "step ms",
    "vs one device",
    "vs data parallel",
    "vs peer gpipe",
    "sim ideal ms",
    "sim lock-step ms",
    "sum of pieces ms",
)
TABLE_COLUMNS = ("row", "compile s", "temp MiB/dev", "args MiB/dev", *TIMING_COLUMNS)


def _timing_cells(rec: dict) -> list[str]:
    """The step time, its ratios and the predictions: the columns both tables end with."""
    return [
        _ms_pair(rec),
        _pair(rec, "vs_one_device"),
        _pair(rec, "vs_data_parallel"),
        _pair(rec, "vs_peer"),
        _ms(rec.get("predicted_overlap_seconds")),
        _ms(rec.get("predicted_lockstep_seconds")),
        _ms(rec.get("work_seconds")),
    ]


def table_markdown(result: dict) -> str:
    """The benchmark table, one section per microbatch count."""
    lines = ["# jpipe benchmark", ""] + _header(result["meta"])
    groups: dict = {}
    for rec in result["rows"]:
        groups.setdefault(rec["microbatches"], []).append(rec)
    for M, recs in groups.items():
        lines += [f"## M = {M} microbatches", ""]
        lines.append("| " + " | ".join(TABLE_COLUMNS) + " |")
        lines.append("|" + "---|" * len(TABLE_COLUMNS))
        for rec in recs:
            if rec.get("error"):
                lines.append(
                    f"| {rec['name']} | not run: {rec['error']} |" + " |" * (len(TABLE_COLUMNS) - 2)
                )
                continue
            lines.append(
                "| "
                + " | ".join(
                    [
                        rec["name"],
                        _s(rec.get("compile_seconds")),
                        mib(rec.get("temp_bytes")),
                        mib(rec.get("argument_bytes")),
                        *_timing_cells(rec),
                    ]
                )
                + " |"
            )
        lines.append("")
    lines += _profile_lines(result.get("profile", {}))
    return "\n".join(lines)


def _plot(result: dict, path: str, metric_pairs) -> str | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, axes = plt.subplots(1, len(metric_pairs), figsize=(6 * len(metric_pairs), 4.5))
    if len(metric_pairs) == 1:
        axes = [axes]
    names = []
    for rec in result["rows"]:
        if rec["name"] not in names:
            names.append(rec["name"])
    for ax, (key, label, scale, log_y) in zip(axes, metric_pairs):
        for name in names:
            pts = sorted(
                (r["microbatches"], r[key] * scale)
                for r in result["rows"]
                if r["name"] == name and r.get(key) is not None
            )
            if pts:
                ax.plot(*zip(*pts), marker="o", label=name)
        ax.set_xscale("log", base=2)
        if log_y:
            ax.set_yscale("log", base=2)
        else:
            ax.set_ylim(bottom=0)
        ax.set_xlabel("microbatches")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(result["meta"]["workload"]["description"], fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _write(result: dict, out: str, stem: str, markdown: str, plot_pairs, plot: bool) -> list[str]:
    paths = []
    path = os.path.join(out, f"{stem}.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=1, default=str)
    paths.append(path)
    path = os.path.join(out, f"{stem}.md")
    with open(path, "w") as f:
        f.write(markdown)
    paths.append(path)
    if plot:
        png = _plot(result, os.path.join(out, f"{stem}.png"), plot_pairs)
        if png:
            paths.append(png)
    return paths


def write_table(result: dict, out: str, plot: bool = True) -> list[str]:
    """Writes ``bench.json``, ``bench.md`` and ``bench.png`` under `out`."""
    pairs = [
        ("vs_one_device", "step time / one device", 1.0, False),
        ("temp_bytes", "temp MiB per device", 1 / 2**20, True),
    ]
    return _write(result, out, "bench", table_markdown(result), pairs, plot)


# -- the compiler suite ------------------------------------------------------------


def _ticks(rec: dict) -> str:
    """A jpipe row's ticks and their layout, or the peer's loop length."""
    if "ticks" in rec:
        layout = rec.get("tick_layout")
        return f"{rec['ticks']} ({layout})" if layout else str(rec["ticks"])
    return str(rec.get("iterations", "-"))


def compiler_markdown(result: dict) -> str:
    """Memory and compile time against M, then the performance shape."""
    lines = ["# jpipe compiler measurements", ""] + _header(result["meta"])
    mem = result["memory"]
    Ms = sorted({r["microbatches"] for r in mem})
    names = []
    for r in mem:
        if r["name"] not in names:
            names.append(r["name"])
    lines += ["## Memory and compile time against microbatches", ""]
    lines.append("| row | " + " | ".join(f"M={M}" for M in Ms) + " | last / first |")
    lines.append("|---|" + "---|" * (len(Ms) + 1))
    for key, what, fmt in (
        ("temp_bytes", "temp MiB/dev", mib),
        ("presplit_temp_bytes", "temp MiB/dev, batch cut before the step", mib),
        ("compile_seconds", "compile s", _s),
    ):
        for name in names:
            vals = {r["microbatches"]: r.get(key) for r in mem if r["name"] == name}
            if all(v is None for v in vals.values()):
                continue
            cells = [fmt(vals.get(M)) for M in Ms]
            first, last = vals.get(Ms[0]), vals.get(Ms[-1])
            ratio = _x(last / first) if first and last is not None else "-"
            lines.append(f"| {name}: {what} | " + " | ".join(cells) + f" | {ratio} |")
    lines.append("")
    perf = result["performance"]
    lines += [f"## Performance at M = {perf['microbatches']}", ""]
    cols = (
        "row",
        "stages",
        "ticks / iterations",
        "compile s",
        "temp MiB/dev",
        *TIMING_COLUMNS,
    )
    lines.append("| " + " | ".join(cols) + " |")
    lines.append("|" + "---|" * len(cols))
    for rec in perf["rows"]:
        if rec.get("error"):
            lines.append(f"| {rec['name']} | not run: {rec['error']} |" + " |" * (len(cols) - 2))
            continue
        lines.append(
            "| "
            + " | ".join(
                [
                    rec["name"],
                    str(rec.get("stages", "-")),
                    _ticks(rec),
                    _s(rec.get("compile_seconds")),
                    mib(rec.get("temp_bytes")),
                    *_timing_cells(rec),
                ]
            )
            + " |"
        )
    lines.append("")
    if perf.get("overhead"):
        lines += ["## Where the time goes (jpipe rows)", ""]
        lines.append(
            "| row | ticks | step ms | all-idle table ms | per tick ms | one device, "
            "microbatched ms | step / microbatched | rest ms | sum of pieces ms |"
        )
        lines.append("|---|---|---|---|---|---|---|---|---|")
        for o in perf["overhead"]:
            lines.append(
                f"| {o['name']} | {o['ticks']} | {_ms(o.get('step_seconds'))} | "
                f"{_ms(o.get('idle_seconds'))} | {_ms(o.get('per_tick_seconds'))} | "
                f"{_ms(o.get('microbatched_seconds'))} | {_x(o.get('vs_microbatched'))} | "
                f"{_ms(o.get('rest_seconds'))} | "
                f"{_ms(o.get('work_seconds'))} |"
            )
        lines.append("")
    lines += _profile_lines(result.get("profile", {}))
    return "\n".join(lines)


def write_compiler(result: dict, out: str, plot: bool = True) -> list[str]:
    """Writes ``compiler.json``, ``compiler.md`` and ``compiler.png`` under `out`."""
    pairs = [
        ("temp_bytes", "temp MiB per device", 1 / 2**20, True),
        ("compile_seconds", "compile seconds", 1.0, False),
    ]
    plot_result = {"meta": result["meta"], "rows": result["memory"]}
    paths = _write(result, out, "compiler", compiler_markdown(result), pairs, False)
    if plot:
        png = _plot(plot_result, os.path.join(out, "compiler.png"), pairs)
        if png:
            paths.append(png)
    return paths


def memory_markdown(rows: list[dict]) -> str:
    """The memory suite's table: compiled bytes per device against the schedule's need."""
    gib = 2**30
    lines = [
        "| devices | blocks | schedule | M | logits | temp GiB | arguments GiB "
        "| need GiB (largest rank) | temp / need | temp / need (2 activations) "
        "| params GiB per device | largest rank's own | params / own |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        slices = r.get("logit_chunks", 1)
        logits = (
            f"{slices} slices" if slices > 1 else "recomputed" if r.get("remat_logits") else "kept"
        )
        lines.append(
            f"| {r['devices']} | {r.get('blocks', 12)} | {r['schedule']} | {r['microbatches']} "
            f"| {logits} "
            f"| {r['temp_bytes'] / gib:.2f} | {r['argument_bytes'] / gib:.2f} "
            f"| {r['need_bytes'] / gib:.2f} | {r['temp_bytes'] / r['need_bytes']:.2f}x "
            f"| {r['temp_bytes'] / r['need_2act_bytes']:.2f}x "
            f"| {r['param_bytes'] / gib:.3f} | {r['own_param_bytes'] / gib:.3f} "
            f"| {r['param_bytes'] / r['own_param_bytes']:.2f}x |"
        )
    return "\n".join(lines) + "\n"


def write_memory(rows: list[dict], out: str) -> list[str]:
    """Writes ``memory.json`` and ``memory.md`` under `out`."""
    paths = [os.path.join(out, "memory.json"), os.path.join(out, "memory.md")]
    with open(paths[0], "w") as f:
        json.dump(rows, f, indent=1)
    with open(paths[1], "w") as f:
        f.write(memory_markdown(rows))
    return paths
