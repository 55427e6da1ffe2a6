"""See a schedule: simulate it and print a chart and its figures.

Usage::

    python -m jpipe.show SPEC [--ranks R] [--microbatches M] [--chunks V] [--option KEY=VALUE]
        [--cost F=1,I=1,W=1,comm=0] [--bytes activation=0,carry=0,params=0]
        [--width 120]
        [--json] [--svg FILE] [--png FILE] [--trace FILE] [--csv FILE]

SPEC is a registered schedule name (``gpipe``), a PyTorch schedule CSV
(``my.csv``, whose ranks and microbatches come from the file), or
``path/to/file.py:function``; options of the schedule function follow a last
colon (``zb_h1:lag=3``) or come one per ``--option lag=3``, as Python
literals. For example::

    python -m jpipe.show gpipe --ranks 4 --microbatches 8 --svg gpipe.svg
    python -m jpipe.show my.csv --cost F=1,I=1,W=1,comm=0.2 --trace my.json

The schedule is validated and simulated (`jpipe.simulate`, costs per kind
given by ``--cost``; ``B`` defaults to ``I + W``). The output is a text chart,
one row per rank (see `text_chart`), then the makespan, the bubble fraction,
and the busy time and peak live activations of each rank (live
``(stage, microbatch)`` pairs; with several stages a rank, also over their
number: microbatches of the rank's layers); with ``--bytes``
(per-stage residual, I-to-W carry and parameter bytes) also each rank's peak
bytes, and beside them the same without the schedule's memory actions
(`jpipe.Schedule.without_memory_actions`; ``--bytes input=...`` sizes what an
``FC`` keeps). Last comes the shape of the program the compiler would build
(`jpipe.make_tick_plan`): its lock-step ticks, and its transfers between ranks,
how many are read in the very next tick (so nothing can hide them) and how
many collectives carry nothing (`jpipe.TickPlan.transfers`), and for a schedule
with memory actions its copies of residuals (evictions and loads between
ranks, offloads and reloads; ``moves`` in the JSON). ``--json`` prints
only one JSON object with those figures instead. ``--svg``/``--png`` draw a
Gantt chart, ``--trace`` writes a Chrome/Perfetto trace (open it at
https://ui.perfetto.dev), and ``--csv`` saves the schedule in PyTorch's CSV
form. A schedule that cannot run, or a bad argument, exits with status 2 and
one line ``error: ...`` on stderr.

The drawing functions are importable from here as well: `text_chart`,
`draw_gantt` and `chrome_trace`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

from jpipe.lower.spmd.ticks import program_shape
from jpipe.runtime.console import run_main
from jpipe.schedule.chart import chrome_trace, draw_gantt, text_chart
from jpipe.schedule.registry import add_option_argument, get_schedule, parse_options
from jpipe.schedule.simulate import Costs, Simulation, Sizes, simulate
from jpipe.schedule.validate import replicas_text

__all__ = ["chrome_trace", "draw_gantt", "main", "text_chart"]


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m jpipe.show",
        description="Validate and simulate a pipeline schedule, and chart it.",
    )
    parser.add_argument(
        "spec", metavar="SPEC", help="a schedule name, a .csv file, or file.py:function"
    )
    parser.add_argument(
        "-r", "--ranks", "--num_ranks", dest="ranks", type=_positive_int, help="number of ranks R"
    )
    parser.add_argument(
        "-m",
        "--microbatches",
        "--num_microbatches",
        dest="microbatches",
        type=_positive_int,
        help="number of microbatches M",
    )
    parser.add_argument(
        "--chunks",
        "--num_chunks",
        dest="chunks",
        type=_positive_int,
        default=None,
        help="chunks (stages) per rank V; default: the schedule's own",
    )
    add_option_argument(parser)
    parser.add_argument(
        "--cost",
        default="",
        metavar="F=1,I=1,W=1,comm=0",
        help="time per kind of action (B defaults to I+W) and cross-rank latency",
    )
    parser.add_argument(
        "--bytes",
        default=None,
        metavar="activation=0,carry=0,params=0,input=0",
        help="bytes per stage: residuals of a microbatch, I-to-W carry, parameters, "
        "what an FC keeps; adds each rank's peak bytes (with and without memory actions)",
    )
    parser.add_argument("--width", type=_positive_int, default=120, help="chart width in columns")
    parser.add_argument(
        "--json", action="store_true", help="print only a JSON object of the figures"
    )
    parser.add_argument("--svg", metavar="FILE", help="draw a Gantt chart to FILE")
    parser.add_argument("--png", metavar="FILE", help="draw a Gantt chart to FILE")
    parser.add_argument("--trace", metavar="FILE", help="write a Chrome/Perfetto trace to FILE")
    parser.add_argument("--csv", metavar="FILE", help="save the schedule as PyTorch CSV to FILE")
    return parser


def _figures(sim: Simulation) -> str:
    s = sim.schedule
    lines = [
        f"makespan         {sim.makespan:g}",
        f"bubble fraction  {sim.bubble_fraction:.4f}",
        "",
        "rank  stages        busy      idle  peak live"
        + ("  peak bytes" if sim.peak_bytes else "")
        + ("  without memory actions" if sim.peak_bytes and s.has_memory_actions else ""),
    ]
    for r in range(s.num_ranks):
        stages = ",".join(str(x) for x in s.stages_of(r)) or "-"
        lines.append(
            f"{r:>4}  {stages:<10}{sim.busy[r]:>8g}{sim.makespan - sim.busy[r]:>10g}"
            f"{sim.peak_activations[r]:>11}"
            + (f"{sim.peak_bytes[r]:>12.4g}" if sim.peak_bytes else "")
            + (
                f"{sim.peak_bytes_without[r]:>25.4g}"
                if sim.peak_bytes and s.has_memory_actions
                else ""
            )
        )
    if any(len(s.stages_of(r)) > 1 for r in range(s.num_ranks)):
        # Several stages a rank: say what "peak live" counts, and in which unit.
        lines += ["", sim.peak_activations_text()]
    return "\n".join(lines)


_MAX_CHART_ACTIONS = 20_000  # a terminal chart of more is slow and unreadable


def main(argv: list[str] | None = None) -> int:
    """Runs the command line; returns the exit status (0, or 2 on an error)."""
    try:
        args = _parser().parse_args(argv)
    except SystemExit as e:  # argparse has printed usage and the error
        return e.code if isinstance(e.code, int) else 2
    try:
        for path, ext in ((args.svg, ".svg"), (args.png, ".png")):
            if path and not path.lower().endswith(ext):
                raise ValueError(f"--{ext[1:]} needs a file name ending in {ext}, got {path!r}")
        costs = Costs.parse(args.cost)
        sizes = None if args.bytes is None else Sizes.parse(args.bytes)
        schedule = get_schedule(
            args.spec, args.ranks, args.microbatches, args.chunks, **parse_options(args.option)
        )
        sim = simulate(schedule, costs, sizes)  # validates first
        # The shape of the program `jpipe.make_tick_plan` would lay out, without its table.
        program = None if schedule.slices else program_shape(schedule, sim=sim)
        written = []
        if args.csv:
            schedule.to_csv(args.csv)
            written.append(args.csv)
        for path in (args.svg, args.png):
            if path:
                draw_gantt(sim, path)
                written.append(path)
        if args.trace:
            chrome_trace(sim, args.trace)
            written.append(args.trace)
    except (ValueError, TypeError, OSError) as e:  # ScheduleError is a ValueError
        print(f"error: {e}", file=sys.stderr)
        return 2

    if args.json:
        print(json.dumps({**sim.summary(), "costs": dataclasses.asdict(costs), "program": program}))
    else:
        actions = sum(len(sim.schedule.actions(r)) for r in range(sim.schedule.num_ranks))
        if actions <= _MAX_CHART_ACTIONS:
            print(text_chart(sim, width=args.width))
        else:
            print(
                f"{sim.schedule.name}: {actions} actions, too many for a terminal chart "
                f"(over {_MAX_CHART_ACTIONS}); --trace F draws them all in Perfetto"
            )
        print()
        print(_figures(sim))
        if program is None:
            print(
                f"program: the SPMD program does not run sequence slices yet "
                f"({sim.schedule.num_sequences} sequences x {sim.schedule.num_slices} "
                "slices); the per-rank lowering does"
            )
        else:
            moves = program.get("moves")
            print(
                f"program: {program['tick_layout']} ticks, {program['ticks']} of them, "
                f"{program['channels']} channel(s); {program['sent']} transfers between "
                f"ranks, {program['exposed']} read the very next tick; "
                f"{program['collectives']} collectives, {program['idle']} with nothing to "
                "send"
                + ("" if moves is None else f"; {moves} copies of residuals (memory actions)")
                + (
                    f"; {replicas_text(sim.schedule)}, gradients summed over the copies"
                    if sim.schedule.replicated
                    else ""
                )
            )
    notes = sys.stderr if args.json else sys.stdout
    for path in written:
        print(f"wrote {path}", file=notes)
    return 0


if __name__ == "__main__":
    sys.exit(run_main(main))
