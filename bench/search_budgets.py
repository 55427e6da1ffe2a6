"""Budgets against winners: `jpipe.search_schedule` on GPT-2 small, each winner compiled.

``python -m bench.search_budgets [--ranks 4] [--budgets 12,10,9,8,7,6] [--layouts spmd,mpmd]
[--microbatches 16] [--json PATH] [--no-compile] [--check SPEC[@V],...]``

For each layout and budget (GiB per device), the search runs on the shipped
GPT-2 small stage profile (``jpipe.load_stage_profile("gpt2_small")``, made
by ``python -m bench.stage_profile``) with R ranks and M microbatches, and
its winner is compiled on GPT-2 small's shapes as `bench.memory` and
`bench.mpmd_memory` compile them (12 blocks, D = 768, L = 1,024, the
50,257-token vocabulary, bfloat16 compute, microbatches of 4 sequences,
fake CPU devices, from shape structs; nothing runs):

- under ``spmd`` the step's one program (`jpipe.Pipeline.step_fn`, as
  ``lowering="spmd"`` runs it): a device holds its ``memory_analysis()``
  arguments, outputs and temp, less what aliases;
- under ``mpmd`` every piece of ``lowering="mpmd"``
  (`jpipe.RankPrograms.compile`), each rank's peak as
  `RankPrograms.account` counts it (its gradient accumulators, the values it
  holds as the op list runs, and the working memory of the piece running
  then) plus the packed parameters it holds (``param_bytes``).

Both add Adam's two moments (two float32 copies of the packed parameters
each device holds), as the search's ``params`` term counts them. Printed: a
markdown row per budget with the winner, its simulated step against
1F1B's (the same figures, the same M), its simulated bytes on the fullest
device, the compiled bytes on the fullest device and against the budget,
and the best built-in that fits with its step against the winner's.

``--check 1f1b,zb_h1,vhalf,interleaved_1f1b@2`` instead compiles the built-ins
named and prints, per layout, the search's simulated bytes on each device
beside the compiled ones (no budget, no margin): the memory model checked.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time

import jpipe

if __name__ == "__main__":
    jpipe.use_cpu_devices(8)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from bench import memory  # noqa: E402
from jpipe import models  # noqa: E402
from jpipe.models import gpt  # noqa: E402

GIB = 2**30


def compiled_bytes(
    schedule: jpipe.Schedule, lowering: str, M: int, config=memory.GPT2_SMALL
) -> dict:
    """Each device's compiled bytes for `schedule` on GPT-2 small, or `config` (module
    docstring)."""
    R, S = schedule.num_ranks, schedule.num_stages
    model = gpt.make_stages(config, models.split_layers(config.num_layers, S))
    mesh = jpipe.make_mesh(R, 1, jax.devices()[:R])
    pipe = jpipe.Pipeline(model.stages, schedule, mesh, lowering=lowering)
    params = jax.eval_shape(model.init, jax.random.key(0))
    packed = pipe.packed_shapes(params)
    weights = sum(
        math.prod(s.shape[1:]) * np.dtype(s.dtype).itemsize for s in packed.values()
    )  # one device's row of every bucket
    adam = 2 * weights
    shape = (M * memory.MICROBATCH, config.seq_len)
    start = time.perf_counter()
    if lowering == "spmd":
        batch = {
            k: jax.ShapeDtypeStruct(shape, jnp.int32, sharding=pipe.batch_sharding)
            for k in ("tokens", "targets")
        }
        m = jax.jit(pipe.step_fn(batch)).lower(packed, batch).compile().memory_analysis()
        step = (
            m.argument_size_in_bytes
            + m.output_size_in_bytes
            + m.temp_size_in_bytes
            - m.alias_size_in_bytes
        )
        device = [step + adam] * R
        rows = pipe.program(batch).arena_rows  # the residual and carry buffers it allocates
        detail = {
            "temp": m.temp_size_in_bytes,
            "argument": m.argument_size_in_bytes,
            "output": m.output_size_in_bytes,
            "alias": m.alias_size_in_bytes,
            # rows of `Program.ROW` raw 32-bit words
            "buffers": [rows[arena] * jpipe.Program.ROW * 4 for arena in ("res", "carry")],
        }
    else:
        batch = {k: jax.ShapeDtypeStruct(shape, jnp.int32) for k in ("tokens", "targets")}
        programs = pipe.rank_programs(batch)
        programs.compile(packed, batch)
        accounts = programs.account()
        device = [a.peak_bytes + a.param_bytes + 2 * a.param_bytes for a in accounts]
        detail = {
            "peak": [a.peak_bytes for a in accounts],
            "params": [a.param_bytes for a in accounts],
            "values": [a.values_bytes for a in accounts],
            "largest_piece": [a.largest_piece_bytes for a in accounts],
        }
    return {
        "device": device,
        "adam": adam,
        "detail": detail,
        "compile_seconds": time.perf_counter() - start,
    }


def rows(R: int, M: int, budgets, layouts, compile_winners: bool = True, log=print) -> list[dict]:
    profile = jpipe.load_stage_profile("gpt2_small")
    cache: dict = {}

    def compiled(schedule, lowering):
        key = (schedule, lowering)
        if key not in cache:
            cache[key] = compiled_bytes(schedule, lowering, M)
            log(
                f"  compiled {schedule.name} ({lowering}) in "
                f"{cache[key]['compile_seconds']:.0f} s: "
                f"{max(cache[key]['device']) / GIB:.2f} GiB on the fullest device"
            )
        return cache[key]

    out = []
    for layout in layouts:
        for budget in budgets:
            result = jpipe.search_schedule(profile, R, M, budget * GIB, layout=layout)
            ref = next(c for c in result.candidates if c.spec == "1f1b" and c.builtin)
            w, bb = result.winner, result.best_builtin
            row = {
                "layout": layout,
                "budget_gib": budget,
                "reference_1f1b": {"time": ref.time, "gib": ref.memory.most / GIB},
                "winner": None,
                "seconds": result.seconds,
            }
            if w is not None:
                row["winner"] = {
                    "label": w.label,
                    "moves": list(w.moves),
                    "time": w.time,
                    "time_vs_1f1b": w.time / ref.time,
                    "simulated_gib": w.memory.most / GIB,
                    "simulated_per_device_gib": [x / GIB for x in w.memory.device],
                }
                if compile_winners:
                    c = compiled(w.schedule, result.lowering)
                    row["winner"]["compiled_gib"] = max(c["device"]) / GIB
                    row["winner"]["compiled_per_device_gib"] = [x / GIB for x in c["device"]]
                    row["winner"]["compiled_detail"] = c["detail"]
            if bb is not None:
                row["best_builtin"] = {"label": bb.label, "time": bb.time,
                                       "gib": bb.memory.most / GIB}  # fmt: skip
            if compile_winners:
                c = compiled(ref.schedule, result.lowering)
                row["reference_1f1b"]["compiled_gib"] = max(c["device"]) / GIB
            log(f"{layout} {budget} GiB: {w.label if w else 'nothing fits'}")
            out.append(row)
    return out


def check_rows(R: int, M: int, specs, layouts, log=print) -> list[dict]:
    """Built-ins compiled beside the search's bytes for them: the memory model checked."""
    profile = jpipe.load_stage_profile("gpt2_small")
    out = []
    for layout in layouts:
        for item in specs:
            spec, _, chunks = item.partition("@")
            result = jpipe.search_schedule(
                profile, R, M, 1e15, layout=layout, schedules=[(spec, int(chunks or 1))],
                local=False, margin=0.0,
            )  # fmt: skip
            c = result.candidates[0]
            compiled = compiled_bytes(c.schedule, result.lowering, M)
            row = {
                "layout": layout,
                "schedule": c.label,
                "simulated_per_device_gib": [x / GIB for x in c.memory.device],
                "compiled_per_device_gib": [x / GIB for x in compiled["device"]],
            }
            if c.memory.buffers is not None and "buffers" in compiled["detail"]:
                row["buffers_gib"] = [x / GIB for x in c.memory.buffers]
                row["program_buffers_gib"] = [x / GIB for x in compiled["detail"]["buffers"]]
            log(f"  {layout} {c.label}: compiled in {compiled['compile_seconds']:.0f} s")
            out.append(row)
    return out


def check_markdown(rows: list[dict]) -> str:
    lines = [
        "| layout | schedule | simulated GiB per device | compiled GiB per device "
        "| compiled / simulated (fullest device) | residual, carry buffers GiB: search "
        "/ program |",
        "|---|---|---|---|---:|---|",
    ]

    def fmt(xs, same):
        return f"{xs[0]:.2f}" if same else " / ".join(f"{x:.2f}" for x in xs)

    for r in rows:
        sim, got = r["simulated_per_device_gib"], r["compiled_per_device_gib"]
        same = r["layout"] == "spmd"  # one program: the same on every device
        buffers = "-"
        if "buffers_gib" in r:
            (a, b), (c, d) = r["buffers_gib"], r["program_buffers_gib"]
            buffers = f"{a:.3f}, {b:.3f} / {c:.3f}, {d:.3f}"
        lines.append(
            f"| {r['layout']} | {r['schedule']} | {fmt(sim, same)} | {fmt(got, same)} "
            f"| {max(got) / max(sim):.3f} | {buffers} |"
        )
    return "\n".join(lines) + "\n"


def markdown(rows: list[dict]) -> str:
    lines = [
        "| layout | budget GiB | 1F1B simulated / compiled GiB | winner | step vs 1F1B "
        "| simulated GiB | compiled GiB | compiled / budget | best built-in that fits "
        "(step vs winner) |",
        "|---|---:|---|---|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        ref = r["reference_1f1b"]
        ref_text = f"{ref['gib']:.2f}" + (
            f" / {ref['compiled_gib']:.2f}" if "compiled_gib" in ref else ""
        )
        w = r["winner"]
        if w is None:
            lines.append(f"| {r['layout']} | {r['budget_gib']:g} | {ref_text} | nothing fits "
                         "| | | | | |")  # fmt: skip
            continue
        bb = r.get("best_builtin")
        bb_text = "-" if bb is None else f"{bb['label']} ({bb['time'] / w['time']:.3f}x)"
        compiled = w.get("compiled_gib")
        compiled_text = (
            "- | -" if compiled is None else (f"{compiled:.2f} | {compiled / r['budget_gib']:.2f}")
        )
        lines.append(
            f"| {r['layout']} | {r['budget_gib']:g} | {ref_text} | {w['label']} "
            f"| {w['time_vs_1f1b']:.3f}x | {w['simulated_gib']:.2f} | {compiled_text} | {bb_text} |"
        )
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--microbatches", type=int, default=16)
    parser.add_argument("--budgets", default="12,10,9,8,7,6", help="GiB per device")
    parser.add_argument("--layouts", default="spmd,mpmd")
    parser.add_argument("--json", help="also write the rows to this path")
    parser.add_argument("--no-compile", action="store_true", help="search only")
    parser.add_argument(
        "--check",
        metavar="SPEC[@V],...",
        help="instead: compile these built-ins and print the search's bytes beside the compiled",
    )
    args = parser.parse_args(argv)
    budgets = [float(x) for x in args.budgets.split(",") if x.strip()]
    layouts = [x.strip() for x in args.layouts.split(",") if x.strip()]
    if args.check:
        specs = [x.strip() for x in args.check.split(",") if x.strip()]
        out = check_rows(args.ranks, args.microbatches, specs, layouts,
                         log=lambda line: print(line, file=sys.stderr))  # fmt: skip
        if args.json:
            with open(args.json, "w") as f:
                json.dump(out, f, indent=1)
        print(check_markdown(out), end="")
        return 0
    out = rows(
        args.ranks,
        args.microbatches,
        budgets,
        layouts,
        compile_winners=not args.no_compile,
        log=lambda line: print(line, file=sys.stderr),
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    print(markdown(out), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
