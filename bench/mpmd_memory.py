"""Each rank's own memory under the per-rank lowering, beside the SPMD program's.

``python -m bench.mpmd_memory [--quick] [--no-spmd] [--memory-actions] [--json PATH]``

GPT-2 small's shapes as in `bench.memory` (12 blocks, D = 768, L = 1024, the
50,257-token vocabulary, bfloat16, microbatches of 4 sequences, M = 16), on 4
and 8 fake CPU devices, for 1F1B, ZB-H1, interleaved 1F1B and ZB-V (the last
two on 4 devices only: 8 ranks x 2 chunks is more stages than 12 blocks fill).
Nothing is run: every piece of the per-rank lowering is compiled from shape
structs on its rank's sub-mesh (`jpipe.RankPrograms.compile`), and each rank's
memory accounted by `RankPrograms.account` (its gradient accumulators, the
values it holds as the op list runs, and the compiled working memory of the
piece running then). Beside it, per rank:

- ``need``: the rank's simulated need (`bench.memory.live_need`: the
  simulator's peak bytes, residuals, carries and gradient accumulators, plus
  its largest piece's working set compiled alone): the target is the per-rank
  peak at most 1.10x of it;
- the SPMD program's per-device temp (the same for every device: one program),
  compiled as `bench.memory.row` does (``--no-spmd`` skips it);
- the parameters each rank holds (today every bucket's row, as packed, like
  the SPMD program: not yet only its own) and its own share;
- the number of ``conditional`` ops in every compiled piece (zero).

``--memory-actions`` runs the built-ins that move residuals instead
(``1f1b_recompute`` with k = 2, ``1f1b_bpipe``, ``zb_h1_offload``) beside
the schedules they start from (1F1B, ZB-H1), with no SPMD column: the SPMD
lowering does not run memory actions yet.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import jpipe

if __name__ == "__main__":
    jpipe.use_cpu_devices(8)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from bench import memory  # noqa: E402
from jpipe import models  # noqa: E402
from jpipe.models import gpt  # noqa: E402

GIB = 2**30


def row(
    num_devices: int, name: str, chunks: int, M: int = 16, spmd: bool = True, **options
) -> dict:
    """One schedule's per-rank figures (see the module docstring)."""
    config = memory.GPT2_SMALL
    schedule = jpipe.get_schedule(name, num_devices, M, chunks if chunks > 1 else None, **options)
    model = gpt.make_stages(config, models.split_layers(config.num_layers, schedule.num_stages))
    mesh = jpipe.make_mesh(num_devices, 1, jax.devices()[:num_devices])
    pipe = jpipe.Pipeline(model.stages, schedule, mesh, lowering="mpmd")
    params = jax.eval_shape(model.init, jax.random.key(0))
    packed = pipe.packed_shapes(params)
    shape = (M * memory.MICROBATCH, config.seq_len)
    batch = {k: jax.ShapeDtypeStruct(shape, jnp.int32) for k in ("tokens", "targets")}
    start = time.perf_counter()
    programs = pipe.rank_programs(batch)
    programs.compile(packed, batch)
    compile_seconds = time.perf_counter() - start
    accounts = programs.account()
    kernels = list(programs.kernels)
    stage_bytes = [memory._bytes(jax.tree.leaves(p)) for p in params]
    need = memory.live_need(schedule, kernels, stage_bytes, memory.piece_working_bytes(kernels))
    own = [0] * num_devices
    for s, b in enumerate(stage_bytes):
        own[schedule.stage_to_rank[s]] += b
    texts = [exe.as_text() for by_kind in programs.compiled.values() for exe in by_kind.values()]
    conditionals = sum(text.count(" conditional(") for text in texts)
    out = {
        "schedule": name + "".join(f" {k}={v}" for k, v in options.items()),
        "chunks": chunks,
        "devices": num_devices,
        "microbatches": M,
        "compile_seconds": compile_seconds,
        "pieces": sum(len(k) for k in programs.compiled.values()),
        "conditionals": conditionals,
        "peak_per_rank": [a.peak_bytes for a in accounts],
        "values_per_rank": [a.values_bytes for a in accounts],
        "largest_piece_per_rank": [a.largest_piece_bytes for a in accounts],
        "grad_per_rank": [a.grad_bytes for a in accounts],
        "param_per_rank": [a.param_bytes for a in accounts],
        "own_param_per_rank": own,
        "need_per_rank": need,
    }
    if spmd:
        spmd_row = memory.row(num_devices, name, chunks, M)
        out["spmd_temp_bytes"] = spmd_row["temp_bytes"]
        out["spmd_need_bytes"] = spmd_row["need_bytes"]
    return out


def cases(quick: bool):
    for D in (4,) if quick else (4, 8):
        for name, chunks in memory.SCHEDULES:
            if D * chunks <= memory.GPT2_SMALL.num_layers + 2:
                yield D, name, chunks, {}


# The built-ins with memory actions (the SPMD lowering does not run them),
# beside the schedules they add actions to.
MEMORY_CASES = [
    ("1f1b", {}),
    ("1f1b_recompute", {"k": 2}),
    ("1f1b_bpipe", {}),
    ("zb_h1", {}),
    ("zb_h1_offload", {}),
]


def memory_cases(quick: bool):
    for D in (4,) if quick else (4, 8):
        for name, options in MEMORY_CASES:
            yield D, name, 1, options


def markdown(rows: list[dict]) -> str:
    """One line per rank: its peak against its need, the SPMD temp beside."""
    lines = [
        "| devices | schedule | rank | per-rank peak GiB | need GiB | peak / need "
        "| live values GiB | largest piece GiB | SPMD temp GiB (every device) "
        "| params held / own GiB |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        for q, (peak, need) in enumerate(zip(r["peak_per_rank"], r["need_per_rank"], strict=True)):
            spmd = f"{r['spmd_temp_bytes'] / GIB:.2f}" if "spmd_temp_bytes" in r else "-"
            lines.append(
                f"| {r['devices']} | {r['schedule']} | {q} | {peak / GIB:.2f} | {need / GIB:.2f} "
                f"| {peak / need:.2f}x | {r['values_per_rank'][q] / GIB:.2f} "
                f"| {r['largest_piece_per_rank'][q] / GIB:.2f} | {spmd} "
                f"| {r['param_per_rank'][q] / GIB:.3f} / {r['own_param_per_rank'][q] / GIB:.3f} |"
            )
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="4 devices only")
    parser.add_argument("--no-spmd", action="store_true", help="skip the SPMD program's compile")
    parser.add_argument("--json", help="also write the rows to this path")
    parser.add_argument(
        "--memory-actions",
        action="store_true",
        help="the built-ins with memory actions beside 1F1B and ZB-H1 (no SPMD column)",
    )
    args = parser.parse_args(argv)
    rows = []
    chosen = memory_cases(args.quick) if args.memory_actions else cases(args.quick)
    for D, name, chunks, options in chosen:
        spmd = not (args.no_spmd or args.memory_actions)
        rec = row(D, name, chunks, spmd=spmd, **options)
        worst = max(p / n for p, n in zip(rec["peak_per_rank"], rec["need_per_rank"], strict=True))
        print(
            f"{D} devices, {name}: {rec['pieces']} pieces compiled in "
            f"{rec['compile_seconds']:.0f} s, {rec['conditionals']} conditionals, "
            f"worst peak / need {worst:.3f}x",
            file=sys.stderr,
        )
        rows.append(rec)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    print(markdown(rows), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
