"""The two shapes of a tick's conditionals, side by side on this jaxlib.

``python -m bench.control [--quick] [--reps 7] [--json]``

`jpipe.Pipeline(control=...)` lowers a tick either with ``"cond"`` (a two-way
`lax.cond` per piece kind around a switch over the stage classes, F a cond
per class: ``classes + 4`` conditionals) or with ``"switch"`` (one
`lax.switch` per piece kind with an idle branch, every branch writing its
buffer in place: 3). ``"auto"`` takes the switch where XLA updates a buffer
in place through one (`jpipe.lower.spmd.program.switch_writes_in_place`). For each
schedule this prints, for both shapes:

- **memory**: GPT-2-small's training step (the real 50,257-token
  vocabulary, bf16, 4 sequences of 1,024 tokens a microbatch, M = 16, 4 fake
  CPU devices) compiled from shapes (`bench.memory.row`): per-device temp
  and the step's conditionals;
- **time**: the benchmark GPT (`bench.workloads` ``gpt``, M = 8, 4 devices),
  both steps compiled and run together in interleaved rounds
  (`bench.measure.time_together`), and the same for the all-idle step
  (every tick idle: what the control alone costs); the median over rounds of
  switch / cond.

``--quick``: the tiny GPT for both, 1F1B and ZB-V only, 3 rounds.
"""

from __future__ import annotations

import argparse
import json
import sys

import jpipe

jpipe.use_cpu_devices(4)

import jax  # noqa: E402

from bench import measure, memory  # noqa: E402
from bench.workloads import get_workload  # noqa: E402
from jpipe.lower.spmd.program import switch_writes_in_place  # noqa: E402
from jpipe.models import gpt  # noqa: E402

SCHEDULES = (("1f1b", 1), ("zb_h1", 1), ("interleaved_1f1b", 2), ("zbv", 2))
CONTROLS = ("cond", "switch")
TINY = gpt.GPTConfig(vocab_size=256, seq_len=32, num_layers=8, num_heads=2, d_model=32, d_ff=64)


def timed_pair(work, name: str, chunks: int, M: int, reps: int, all_idle: bool) -> dict:
    """Median over interleaved rounds of the switch's step time over the cond's."""
    devices = jax.devices()[:4]
    programs = []
    for control in CONTROLS:
        schedule = jpipe.get_schedule(name, 4, M, chunks if chunks > 1 else None)
        fns, params = work.stages(schedule.num_stages)
        pipe = jpipe.Pipeline(
            fns, schedule, jpipe.make_mesh(4, 1, devices), control=control, all_idle=all_idle
        )
        packed = pipe.pack(params)
        batch = jax.device_put(work.batch(M), pipe.batch_sharding)
        programs.append(
            measure.compile_program(control, jax.jit(pipe.step_fn(batch)), (packed, batch))
        )
    times = measure.time_together(programs, reps, warmup=1)
    ratio = measure.median([s / c for s, c in zip(times["switch"], times["cond"])])
    return {
        "cond_ms": measure.median(times["cond"]) * 1e3,
        "switch_ms": measure.median(times["switch"]) * 1e3,
        "switch_over_cond": ratio,
    }


def run(args) -> list[dict]:
    config = TINY if args.quick else memory.GPT2_SMALL
    work = get_workload("tiny-gpt" if args.quick else "gpt")
    schedules = (SCHEDULES[0], SCHEDULES[3]) if args.quick else SCHEDULES
    reps = 3 if args.quick else args.reps
    rows = []
    for name, chunks in schedules:
        row = {"schedule": name}
        for control in CONTROLS:
            rec = memory.row(4, name, chunks, 16, config, control=control)
            row[f"{control}_temp_bytes"] = rec["temp_bytes"]
            row[f"{control}_conditionals"] = rec["conditionals"]
        row["step"] = timed_pair(work, name, chunks, 8, reps, all_idle=False)
        row["idle_step"] = timed_pair(work, name, chunks, 8, reps, all_idle=True)
        rows.append(row)
        if not args.json:
            gib = 2**30
            print(
                f"{name}: temp {row['cond_temp_bytes'] / gib:.2f} GiB with conds "
                f"({row['cond_conditionals']} conditionals), "
                f"{row['switch_temp_bytes'] / gib:.2f} GiB with switches "
                f"({row['switch_conditionals']}); step time switch / cond "
                f"{row['step']['switch_over_cond']:.3f}, all-idle step "
                f"{row['idle_step']['switch_over_cond']:.3f}",
                flush=True,
            )
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.control", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--quick", action="store_true", help="tiny GPT, two schedules, 3 rounds")
    parser.add_argument("--reps", type=int, default=7, help="timed rounds")
    parser.add_argument("--json", action="store_true", help="one JSON object")
    args = parser.parse_args(argv)
    in_place = switch_writes_in_place("cpu")
    head = {"jax": jax.__version__, "switch_writes_in_place": in_place}
    if not args.json:
        print(
            f"jax {jax.__version__}: XLA:CPU updates buffers in place through a switch: {in_place}"
        )
    rows = run(args)
    if args.json:
        print(json.dumps({**head, "rows": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
