"""Charts of a simulated schedule: terminal text, a Gantt figure, a Chrome trace.

All three read a `jpipe.Simulation` and nothing else, so they show exactly
what the simulator computed.

- `text_chart` draws one row per rank. When every action is wide enough to
  carry its label, time runs to scale (``F3 F4 B3--- ...``, ``-`` while an
  action runs, ``.`` while the rank idles). When the chart would not fit the
  width that way, it falls back to listing actions in order of start time:
  one column per distinct start time, wrapped into blocks, so actions that
  start together stay aligned but time is no longer to scale.
- `draw_gantt` draws the same timeline with matplotlib (Agg, no display
  needed): colour by kind, lighter for later microbatches, labels inside bars
  that are wide enough, a black outline around each overlapped (DualPipe) cell.
- `chrome_trace` writes the timeline as Chrome/Perfetto trace events
  (``chrome://tracing``, https://ui.perfetto.dev), one track per rank.

Labels are ``F3`` (kind and microbatch) when every rank holds one stage, and
``F3s2`` (stage 2) when some rank holds several.

Memory actions have glyphs of their own: ``f3`` a forward that keeps only its
input (``FC``), ``R3`` its recompute, on the rank's row; the transfers, which
run beside the compute, on a row of their own under the rank (``r0 mem``):
``E3`` an eviction to the partner, ``L3`` the load back, ``H3`` an offload to
the host (from ``OFFLOAD_START``), ``D3`` the reload to the device (from
``RELOAD_START``). The ends (``OFFLOAD_END``, ``RELOAD_END``) take no time and
are not drawn; a wait at one shows as the rank idling.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence

from jpipe.schedule.simulate import Event, Simulation

_KIND_NAMES = {
    "F": "forward",
    "B": "backward",
    "I": "input grad",
    "W": "weight grad",
    "FC": "forward keeping its input",
    "RECOMPUTE": "recompute",
    "EVICT": "evict to partner",
    "LOAD": "load from partner",
    "OFFLOAD_START": "offload to host",
    "RELOAD_START": "reload from host",
}
_KIND_COLORS = {
    "F": "#3b6fb6",
    "B": "#3a9a5b",
    "I": "#e07b39",
    "W": "#8064b4",
    "FC": "#8fb0dd",
    "RECOMPUTE": "#c94f7c",
    "EVICT": "#a08030",
    "LOAD": "#d4b44a",
    "OFFLOAD_START": "#707070",
    "RELOAD_START": "#a8a8a8",
}
# The letter each drawn kind is labelled with (the ends of an offload or reload are not drawn).
_GLYPHS = {
    "F": "F",
    "B": "B",
    "I": "I",
    "W": "W",
    "FC": "f",
    "RECOMPUTE": "R",
    "EVICT": "E",
    "LOAD": "L",
    "OFFLOAD_START": "H",
    "RELOAD_START": "D",
}
_TRANSFER_KINDS = ("EVICT", "LOAD", "OFFLOAD_START", "RELOAD_START")
_SYNC_COLOR = "#c0c0c0"  # a replicated stage's gradient sum (`Simulation.syncs`)
_LEGEND = "F forward, B backward, I input grad, W weight grad; '-' running, '.' idle"
_MEMORY_LEGEND = (
    "f forward keeping only its input, R recompute; on a 'mem' row: E evict to the "
    "partner, L load back, H offload to host, D reload from host"
)


# -- shared helpers ---------------------------------------------------------------


def _fmt(x: float) -> str:
    """A time or cost without a trailing ``.0``."""
    return str(int(x)) if float(x).is_integer() else f"{x:.4g}"


def _multi_stage(sim: Simulation) -> bool:
    schedule = sim.schedule
    return any(len(schedule.stages_of(r)) > 1 for r in range(schedule.num_ranks))


def _label(event: Event, with_stage: bool) -> str:
    a = event.action
    return f"{_GLYPHS[a.kind]}{a.microbatch}" + (f"s{a.stage}" if with_stage else "")


def _rank_events(sim: Simulation) -> list[list[Event]]:
    """The compute on the timeline split by rank, each in the rank's order."""
    rows: list[list[Event]] = [[] for _ in range(sim.schedule.num_ranks)]
    for e in sim.timeline:
        if e.action.kind in _GLYPHS and e.action.kind not in _TRANSFER_KINDS:
            rows[e.rank].append(e)
    return rows


def _transfer_events(sim: Simulation) -> list[list[Event]]:
    """The transfers (memory actions beside the compute) split by rank."""
    rows: list[list[Event]] = [[] for _ in range(sim.schedule.num_ranks)]
    for e in sim.timeline:
        if e.action.kind in _TRANSFER_KINDS:
            rows[e.rank].append(e)
    return rows


def _t0(sim: Simulation) -> float:
    return min((e.start for e in sim.timeline), default=0.0)


def _headline(sim: Simulation) -> str:
    s = sim.schedule
    return (
        f"{s.name or 'schedule'}: {s.num_ranks} ranks, {s.num_stages} stages, "
        + (
            f"{s.num_sequences} sequences x {s.num_slices} slices"
            if s.slices
            else f"{s.num_microbatches} microbatches"
        )
        + f"; makespan {_fmt(sim.makespan)}, "
        f"bubble {sim.bubble_fraction:.1%}"
    )


def _row_names(sim: Simulation) -> list[str]:
    s = sim.schedule
    return [
        f"r{r} s" + ",".join(str(x) for x in s.stages_of(r)) if s.stages_of(r) else f"r{r}"
        for r in range(s.num_ranks)
    ]


# -- terminal ---------------------------------------------------------------------


def text_chart(sim: Simulation, width: int = 120) -> str:
    """Draws `sim` as text, one row per rank, at most about `width` columns wide.

    Args:
      sim: what `jpipe.simulate` returned.
      width: the widest line wanted; time is drawn to scale when the chart fits.

    Returns:
      The chart as lines of text (no trailing newline).
    """
    with_stage = _multi_stage(sim)
    names, rows, fixed = [], [], []  # `fixed`: a row whose labels must fit (not a mem row)
    for r, (name, compute, moves) in enumerate(
        zip(_row_names(sim), _rank_events(sim), _transfer_events(sim), strict=True)
    ):
        names.append(name)
        rows.append(compute)
        fixed.append(True)
        if moves:
            names.append(f"r{r} mem")
            rows.append(moves)
            fixed.append(False)
    name_w = max(len(n) for n in [*names, "time"]) + 2
    body_w = max(width - name_w, 10)
    labels = [[_label(e, with_stage) for e in row] for row in rows]
    t0 = _t0(sim)
    # A transfer that takes no time (the default costs) has no room of its own: it
    # is drawn as its glyph and does not keep time from running to scale.
    sized = [
        [(e, text) for e, text in zip(row, row_labels, strict=True) if must or e.end > e.start]
        for row, row_labels, must in zip(rows, labels, fixed, strict=True)
    ]
    scale = _fit_scale(
        [[e for e, _ in row] for row in sized],
        [[text for _, text in row] for row in sized],
        t0,
        sim.makespan,
        body_w,
    )
    if scale is not None:
        body = _scaled(rows, labels, names, name_w, t0, sim.makespan, scale)
        mode = f"time to scale, {_fmt(round(scale, 3))} columns per unit"
    else:
        body = _ordered(rows, labels, names, name_w, body_w)
        mode = f"actions by start time, not to scale (to scale it would exceed {width} columns)"
    legend = [_LEGEND] + ([_MEMORY_LEGEND] if sim.schedule.has_memory_actions else [])
    return "\n".join([_headline(sim), mode, *body, *legend])


def _columns(start: float, end: float, t0: float, scale: float) -> tuple[int, int]:
    return math.floor((start - t0) * scale + 0.5), math.floor((end - t0) * scale + 0.5)


def _fit_scale(rows, labels, t0, makespan, body_w) -> float | None:
    """The fewest columns per time unit that fit every label, or None."""
    needed = 0.0
    for row, row_labels in zip(rows, labels, strict=True):
        for e, text in zip(row, row_labels, strict=True):
            duration = e.end - e.start
            if duration <= 0:
                return None  # an action that takes no time has no room on a time axis
            needed = max(needed, (len(text) + 1) / duration)
    if needed == 0 or makespan <= 0:
        return None
    # Whole columns per unit keep integer times on whole columns, when there is room.
    candidates = [float(math.ceil(needed))] if math.ceil(needed) * makespan <= body_w else []
    candidates += [needed * (1 + 0.05 * k) for k in range(20)]
    for scale in candidates:
        if math.floor(makespan * scale + 0.5) > body_w:
            continue
        if all(
            _columns(e.start, e.end, t0, scale)[1] - _columns(e.start, e.end, t0, scale)[0]
            >= len(text) + 1
            for row, row_labels in zip(rows, labels, strict=True)
            for e, text in zip(row, row_labels, strict=True)
        ):
            return scale
    return None


def _scaled(rows, labels, names, name_w, t0, makespan, scale) -> list[str]:
    total = math.floor(makespan * scale + 0.5)
    lines = ["time".ljust(name_w) + _axis(total, scale)]
    for name, row, row_labels in zip(names, rows, labels, strict=True):
        line = ["."] * total
        for e, text in zip(row, row_labels, strict=True):
            c0, c1 = _columns(e.start, e.end, t0, scale)
            if c1 - c0 >= len(text) + 1:
                bar = text + "-" * (c1 - c0 - len(text) - 1) + " "
            else:  # a transfer too short for its label: as much of it as fits, at least the glyph
                c0 = min(c0, max(total - 1, 0))
                c1 = max(c1, c0 + 1)
                bar = text[: c1 - c0]
            line[c0:c1] = bar
        lines.append(name.ljust(name_w) + "".join(line[:total]).rstrip())
    return lines


def _axis(total: int, scale: float) -> str:
    """Tick labels at round times, at least 8 columns apart."""
    steps = sorted(m * 10.0**e for e in range(-3, 12) for m in (1, 2, 5))
    step = next((x for x in steps if x * scale >= 8), steps[-1])
    axis = [" "] * (total + 8)
    t = 0.0
    while True:
        col = math.floor(t * scale + 0.5)
        if col > total:
            break
        text = _fmt(t)
        axis[col : col + len(text)] = text
        t += step
    return "".join(axis).rstrip()


def _ordered(rows, labels, names, name_w, body_w) -> list[str]:
    """One column per distinct start time, wrapped into blocks of `body_w`."""
    # A key (time, k) gives the k-th action a rank starts at that time, so that
    # actions taking no time still get a column of their own.
    keyed = []
    for row in rows:
        keys, seen = [], {}
        for e in row:
            k = seen.get(e.start, 0)
            seen[e.start] = k + 1
            keys.append((e.start, k))
        keyed.append(keys)
    columns = sorted({key for keys in keyed for key in keys})
    cell_w = max(len(text) for row_labels in labels for text in row_labels) + 1
    cells = []
    for row, row_labels, keys in zip(rows, labels, keyed, strict=True):
        at = {key: i for i, key in enumerate(keys)}
        running_until = -math.inf
        row_cells = []
        for key in columns:
            i = at.get(key)
            if i is not None:
                row_cells.append(row_labels[i].ljust(cell_w))
                running_until = row[i].end
            elif key[0] < running_until:
                row_cells.append("-".ljust(cell_w))
            else:
                row_cells.append(".".ljust(cell_w))
        cells.append(row_cells)
    per_block = max(body_w // cell_w, 1)
    lines = []
    for b in range(0, len(columns), per_block):
        block = columns[b : b + per_block]
        times = "".join(
            (_fmt(t) if k == 0 and len(_fmt(t)) < cell_w else "").ljust(cell_w) for t, k in block
        )
        if b:
            lines.append("")
        lines.append("start".ljust(name_w) + times.rstrip())
        for name, row_cells in zip(names, cells, strict=True):
            lines.append(name.ljust(name_w) + "".join(row_cells[b : b + per_block]).rstrip())
    return lines


# -- matplotlib -------------------------------------------------------------------


def draw_gantt(sim: Simulation, path: str | os.PathLike, *, dpi: int = 150) -> None:
    """Draws `sim` as a Gantt chart and saves it; the extension picks SVG or PNG.

    Args:
      sim: what `jpipe.simulate` returned.
      path: where to save; must end in ``.svg`` or ``.png``.
      dpi: resolution of a PNG.
    """
    ext = os.path.splitext(os.fspath(path))[1].lower()
    if ext not in (".svg", ".png"):
        raise ValueError(f"cannot draw a Gantt chart to {os.fspath(path)!r}: use .svg or .png")
    # Imported here: matplotlib is slow to import and only the figures need it.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch, Rectangle

    schedule = sim.schedule
    R, M = schedule.num_ranks, max(schedule.num_microbatches, 1)
    with_stage = _multi_stage(sim)
    rows = _rank_events(sim)
    overlapped = _overlapped(sim)
    overlapped_spans = _overlapped_spans(rows, overlapped)
    t0, span = _t0(sim), max(sim.makespan, 1e-9)

    most = max((len(row) for row in rows), default=1)
    fig_w = min(max(8.0, 0.32 * most + 2.5), 32.0)
    fig_h = 1.6 + 0.6 * R
    fig = Figure(figsize=(fig_w, fig_h), layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    font = 7
    # Width of one character in data units, to decide which labels fit.
    axes_w_in = fig_w * 0.8
    char_w = font * 0.62 / 72 * span / axes_w_in

    for r, row in enumerate(rows):
        for e in row:
            a = e.action
            color = _shade(_KIND_COLORS[a.kind], a.microbatch / max(M - 1, 1))
            ax.barh(
                r,
                e.end - e.start,
                left=e.start - t0,
                height=0.8,
                color=color,
                edgecolor="white",
                linewidth=0.6,
            )
            # Two short lines fit narrower bars than one long label would.
            text = f"{_GLYPHS[a.kind]}{a.microbatch}" + (f"\ns{a.stage}" if with_stage else "")
            if max(map(len, text.split())) * char_w <= 0.92 * (e.end - e.start):
                ax.text(
                    (e.start + e.end) / 2 - t0,
                    r,
                    text,
                    ha="center",
                    va="center",
                    fontsize=font,
                    color=_text_color(color),
                )

    for r, row in enumerate(_transfer_events(sim)):  # beside the compute: a thin bar below it
        for e in row:
            a = e.action
            ax.barh(
                r + 0.3,
                max(e.end - e.start, span * 0.002),  # a transfer taking no time stays visible
                left=e.start - t0,
                height=0.22,
                color=_KIND_COLORS[a.kind],
                edgecolor="black",
                linewidth=0.3,
                hatch="///",
            )
    for x in sim.syncs:  # a replicated stage's gradient sum, on each rank holding a copy
        for r in x.ranks:
            ax.barh(
                r + 0.3,
                max(x.end - x.start, span * 0.002),
                left=x.start - t0,
                height=0.22,
                color=_SYNC_COLOR,
                edgecolor="black",
                linewidth=0.3,
                hatch="...",
            )
    for r, start, end in overlapped_spans:
        ax.add_patch(
            Rectangle(
                (start - t0, r - 0.45),
                end - start,
                0.9,
                fill=False,
                edgecolor="black",
                linewidth=1.0,
            )
        )
    ax.set_yticks(range(R), _row_names(sim))
    ax.set_ylim(R - 0.5, -0.5)  # rank 0 on top
    ax.set_xlim(0, span)
    ax.set_xlabel("time (simulated units)")
    ax.grid(axis="x", color="#dddddd", linewidth=0.5)
    ax.set_axisbelow(True)
    ax.set_title(
        f"{schedule.name or 'schedule'}: {R} ranks, {schedule.num_microbatches} microbatches"
        f" — makespan {_fmt(sim.makespan)}, bubble {sim.bubble_fraction:.1%}",
        fontsize=10,
    )
    kinds = [k for k in _KIND_NAMES if any(e.action.kind == k for e in sim.timeline)]
    handles = [
        Patch(color=_KIND_COLORS[k], label=f"{_GLYPHS[k]} {_KIND_NAMES[k]}")
        if k not in _TRANSFER_KINDS
        else Patch(facecolor=_KIND_COLORS[k], hatch="///", edgecolor="black", label=_KIND_NAMES[k])
        for k in kinds
    ]
    if overlapped:
        handles.append(Patch(fill=False, edgecolor="black", label="overlapped F and B (one cell)"))
    if sim.syncs:
        handles.append(
            Patch(facecolor=_SYNC_COLOR, hatch="...", edgecolor="black", label="gradient sum")
        )
    fig.legend(
        handles=handles, loc="outside lower center", ncols=len(handles), fontsize=8, frameon=False
    )
    fig.savefig(os.fspath(path), dpi=dpi)


def _overlapped(sim: Simulation) -> set[tuple[int, object]]:
    """`(rank, action)` of every plain action that is half of an Overlap cell."""
    marked = set()
    for r, row in enumerate(sim.schedule.ranks):
        for step in row:
            if len(step.parts) > 1:
                marked.update((r, a) for a in step.parts)
    return marked


def _overlapped_spans(rows, overlapped) -> list[tuple[int, float, float]]:
    """`(rank, start, end)` of each Overlap cell: its two halves run back to back."""
    spans = []
    for r, row in enumerate(rows):
        i = 0
        while i < len(row):
            if (r, row[i].action) in overlapped and i + 1 < len(row):
                spans.append((r, row[i].start, row[i + 1].end))
                i += 2
            else:
                i += 1
    return spans


def _shade(hex_color: str, fraction: float) -> tuple[float, float, float]:
    """`hex_color` mixed with up to 45% white, more for larger `fraction`."""
    rgb = [int(hex_color[i : i + 2], 16) / 255 for i in (1, 3, 5)]
    mix = 0.45 * fraction
    return tuple(c + (1 - c) * mix for c in rgb)


def _text_color(rgb: Sequence[float]) -> str:
    luminance = 0.299 * rgb[0] + 0.587 * rgb[1] + 0.114 * rgb[2]
    return "black" if luminance > 0.6 else "white"


# -- Chrome / Perfetto trace ------------------------------------------------------


def chrome_trace(
    sim: Simulation, path: str | os.PathLike | None = None, *, us_per_unit: float = 1000.0
) -> dict:
    """The timeline as a Chrome/Perfetto trace; written as JSON to `path` if given.

    Each rank is a process (``pid``) with one thread (``tid``, equal to the
    rank); each action is a complete event (``ph: "X"``) named like
    ``F s2 m3``.

    Args:
      sim: what `jpipe.simulate` returned.
      path: where to write the JSON, if anywhere.
      us_per_unit: microseconds per simulated time unit (the default makes one
        unit a millisecond).

    Returns:
      The trace, ``{"traceEvents": [...], ...}``.
    """
    schedule = sim.schedule
    t0 = _t0(sim)
    events: list[dict] = []
    for r in range(schedule.num_ranks):
        stages = ", ".join(str(s) for s in schedule.stages_of(r))
        for name, args in (
            ("process_name", {"name": f"rank {r}" + (f" (stages {stages})" if stages else "")}),
            ("process_sort_index", {"sort_index": r}),
            ("thread_name", {"name": "compute"}),
        ):
            events.append({"name": name, "ph": "M", "pid": r, "tid": r, "args": args})
    overlapped = _overlapped(sim)
    R = schedule.num_ranks
    for r, (compute, moves) in enumerate(zip(_rank_events(sim), _transfer_events(sim))):
        syncs = [x for x in sim.syncs if r in x.ranks]
        if moves or syncs:  # transfers and gradient sums run beside the compute
            events.append(
                {
                    "name": "thread_name",
                    "ph": "M",
                    "pid": r,
                    "tid": R + r,
                    "args": {"name": "transfers"},
                }
            )
        for x in syncs:
            events.append(
                {
                    "name": f"gradient sum s{x.stage}",
                    "cat": "gradient sum",
                    "ph": "X",
                    "pid": r,
                    "tid": R + r,
                    "ts": (x.start - t0) * us_per_unit,
                    "dur": (x.end - x.start) * us_per_unit,
                    "args": {"stage": x.stage, "ranks": list(x.ranks)},
                }
            )
        for e in compute + moves:
            a = e.action
            args = {"kind": a.kind, "stage": a.stage, "microbatch": a.microbatch}
            if a.partner is not None:
                args["partner"] = a.partner
            events.append(
                {
                    "name": f"{a.kind} s{a.stage} m{a.microbatch}",
                    "cat": _KIND_NAMES[a.kind],
                    "ph": "X",
                    "pid": r,
                    "tid": r if a.kind not in _TRANSFER_KINDS else R + r,
                    "ts": (e.start - t0) * us_per_unit,
                    "dur": (e.end - e.start) * us_per_unit,
                    "args": {**args, "overlapped": (r, a) in overlapped},
                }
            )
    trace = {
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "otherData": {**sim.summary(), "us_per_unit": us_per_unit},
    }
    if path is not None:
        with open(path, "w") as f:
            json.dump(trace, f)
    return trace
