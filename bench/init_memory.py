"""What each device allocates to make its parameters in place, compiled, not run.

``python -m bench.init_memory [--layers N] [--json]``

For ``configs/gpt_1b_8gpu.py``'s GPT (GPT-3 XL's sizes: 24 blocks, D = 2048,
16 heads, d_ff = 8192, GPT-2's 50,257-token vocabulary; 1.42B parameters) on
8 fake CPU devices,
compiles `jpipe.Pipeline.init_programs` (one program per rank, on that rank's
devices) for three meshes and reads each program's per-device
`memory_analysis()`: its output (the device's block of the packed
parameters) and its temporaries. Nothing is made: the programs are compiled
for a key's shape. The table holds, per mesh, the largest device's output and
output + temp, against the largest rank's stages whole and the whole model,
so it shows from what is allocated that no device holds the model (nor, with
fsdp or tensor, even its own stages whole) while its parameters are made.
"""

from __future__ import annotations

import argparse
import json
import math
import sys

MESHES = ({"pipe": 8}, {"pipe": 4, "fsdp": 2}, {"pipe": 2, "fsdp": 2, "tensor": 2})


def config(num_layers: int | None = None):
    """``configs/gpt_1b_8gpu.py``'s model, optionally with fewer blocks."""
    import dataclasses

    from bench.mesh_memory import load_config

    model = load_config().model
    return dataclasses.replace(model, num_layers=num_layers) if num_layers else model


def row(cfg, axes: dict) -> dict:
    import jax

    import jpipe
    from jpipe import models
    from jpipe.models import gpt

    R = axes["pipe"]
    mesh = jpipe.make_mesh(R, 1, fsdp=axes.get("fsdp", 1), tensor=axes.get("tensor", 1))
    tensor = "tensor" if axes.get("tensor", 1) > 1 else None
    model = gpt.make_stages(cfg, models.split_layers(cfg.num_layers, R), tensor_axis=tensor)
    pipe = jpipe.Pipeline(model.stages, jpipe.get_schedule("1f1b", R, R), mesh)
    key = jax.random.key(0)
    shapes = jax.eval_shape(model.init, key)
    specs = gpt.tensor_specs(cfg, shapes) if tensor else None
    stage_bytes = [
        sum(math.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(p)) for p in shapes
    ]
    out, total = 0, 0
    for program in pipe.init_programs(model.init, key, specs):
        memory = program.lower(key).compile().memory_analysis()
        out = max(out, memory.output_size_in_bytes)
        total = max(total, memory.output_size_in_bytes + memory.temp_size_in_bytes)
    own = [0] * R
    for s, b in enumerate(stage_bytes):
        own[pipe.tick_plan.stage_to_rank[s]] += b
    return {
        "mesh": axes,
        "output_bytes": int(out),
        "output_and_temp_bytes": int(total),
        "own_stages_bytes": max(own),
        "model_bytes": sum(stage_bytes),
    }


def markdown(rows) -> str:
    gib = 2**30
    lines = [
        "| mesh | output / device | output + temp / device | largest rank's stages | model |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        name = " x ".join(f"{k} {v}" for k, v in r["mesh"].items())
        lines.append(
            f"| {name} | {r['output_bytes'] / gib:.2f} GiB | "
            f"{r['output_and_temp_bytes'] / gib:.2f} GiB | {r['own_stages_bytes'] / gib:.2f} GiB | "
            f"{r['model_bytes'] / gib:.2f} GiB |"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=None, help="blocks (default: the config's)")
    parser.add_argument("--json", action="store_true", help="print one JSON list")
    from bench import docs

    docs.add_flag(parser, "docs/compiler-measurements.md")
    args = parser.parse_args(argv)
    import jax

    jax.config.update("jax_num_cpu_devices", 8)
    cfg = config(args.layers)
    rows = []
    for axes in MESHES:
        print(f"compiling the init programs for {axes} ...", file=sys.stderr, flush=True)
        rows.append(row(cfg, axes))
    print(json.dumps(rows) if args.json else markdown(rows))
    if args.write_docs:
        command = docs.command_line("bench.init_memory", argv)
        docs.write("docs/compiler-measurements.md", "init-memory", markdown(rows), command)
    return 0


if __name__ == "__main__":
    sys.exit(main())
