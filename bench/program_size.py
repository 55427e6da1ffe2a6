"""How the compiled program grows with the pipeline's depth.

``python -m bench.program_size [--ranks 4,16] [--reps 3]``

Compiles (does not run) 1F1B training steps of a small GPT (vocabulary 256,
L = 32, D = 64, one block per stage, M = 2R) on R fake CPU devices from
shapes alone, and prints per R: the conditionals and dots in the optimized
HLO, the median compile seconds over `--reps` fresh compiles (tracing
included), and the per-device temp bytes. Stages of one structure share one
branch of the program (`jpipe.Program.classes`), so the dots should not
grow with R. Prints one JSON object per line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import jpipe

jpipe.use_cpu_devices(16)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from jpipe import models  # noqa: E402
from jpipe.models import gpt  # noqa: E402


def measure(ranks: int, reps: int) -> dict:
    config = gpt.GPTConfig(
        vocab_size=256, seq_len=32, num_layers=ranks, num_heads=2, d_model=64, d_ff=128
    )
    M = 2 * ranks
    seconds = []
    for _ in range(reps):
        schedule = jpipe.get_schedule("1f1b", ranks, M)
        model = gpt.make_stages(config, models.split_layers(config.num_layers, ranks))
        mesh = jpipe.make_mesh(ranks, 1, jax.devices()[:ranks])
        pipe = jpipe.Pipeline(model.stages, schedule, mesh)
        packed = pipe.packed_shapes(jax.eval_shape(model.init, jax.random.key(0)))
        batch = {
            k: jax.ShapeDtypeStruct(
                (2 * M, config.seq_len), jnp.int32, sharding=pipe.batch_sharding
            )
            for k in ("tokens", "targets")
        }
        start = time.perf_counter()
        compiled = jax.jit(pipe.step_fn(batch)).lower(packed, batch).compile()
        seconds.append(time.perf_counter() - start)
    hlo = compiled.as_text()
    return {
        "ranks": ranks,
        "conditionals": hlo.count(" conditional("),
        "dots": hlo.count(" dot("),
        "compile_s": round(statistics.median(seconds), 2),
        "temp_bytes": compiled.memory_analysis().temp_size_in_bytes,
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.program_size", description=__doc__)
    parser.add_argument("--ranks", default="4,16", help="comma-separated rank counts (at most 16)")
    parser.add_argument("--reps", type=int, default=3, help="compiles per point")
    args = parser.parse_args(argv)
    for ranks in (int(r) for r in args.ranks.split(",")):
        print(json.dumps(measure(ranks, args.reps)), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
