"""GPT-2 small's stage profile for `jpipe.search`: each stage's FLOPs and bytes, from shapes.

``python -m bench.stage_profile [--out jpipe/_data/profiles/gpt2_small.json] [--stages 2,4,6,8,12]``

For GPT-2 small's shapes as `bench.memory` has them (12 blocks, D = 768,
12 heads, L = 1,024, the 50,257-token vocabulary, bfloat16 compute, float32
parameters, microbatches of 4 sequences), for each number of stages S the
model is cut as the trainer cuts it (`jpipe.models.split_layers`: the
embedding on the first stage, the head on the last) and every stage's F, I
and W pieces (`jpipe.StageKernels`, the pieces both lowerings run) are
compiled alone on one CPU device from shape structs. Nothing is run. Per
stage it writes:

- ``flops``: ``F``, ``I``, ``W`` from XLA's ``cost_analysis()`` of each
  compiled piece, and ``recompute`` (taken as the F's: a RECOMPUTE runs the
  stage's forward again);
- ``activation``: the residual bytes one microbatch keeps from F to its
  backward (`StageKernels.res_avals`), ``carry`` what an I hands its W
  (``carry_avals``), ``output`` the activation it sends on, ``input`` what an
  FC keeps (the previous stage's output; 0 for the first, whose input is
  the batch);
- ``params``: 16 bytes per parameter of the stage's own (float32 weights,
  their gradient accumulator, Adam's two moments); ``grad_output``: 4 bytes
  per parameter, the gradients the SPMD step returns beside its accumulator;
- ``working``: its largest piece's working memory, as `bench.memory`'s
  `piece_working_bytes` counts it (compiled temp and output, plus the
  activation in and out).

``rates`` turn FLOPs and bytes into seconds. They are assumptions, not
measurements (no accelerator was used): an H100 SXM reaching 40% of its
989 TFLOP/s dense bfloat16 peak, NVLink 4 at 200 GB/s per direction between
ranks (evictions, and the activation a stage sends on), and 25 GB/s to
pinned host memory (offloads). `python -m jpipe.search --rate` overrides any.
The file is `jpipe/_data/profiles/gpt2_small.json` (``--profile gpt2_small``).
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

OUT = "jpipe/_data/profiles/gpt2_small.json"
RATES = {
    "flops_per_second": 0.4 * 989e12,
    "partner_bytes_per_s": 200e9,
    "host_bytes_per_s": 25e9,
}
PARAM_BYTES = 16  # float32 weight, gradient, and Adam's two moments, per parameter


def _bytes(avals) -> int:
    return sum(math.prod(a.shape) * np.dtype(a.dtype).itemsize for a in avals)


def _pipeline(num_stages: int, config=memory.GPT2_SMALL, M: int = 8):
    """A pipeline whose schedule has `num_stages` stages, on at most 4 fake devices."""
    R = next(r for r in (4, 2, 1) if num_stages % r == 0 and r <= num_stages)
    V = num_stages // R
    schedule = jpipe.get_schedule(
        "1f1b" if V == 1 else "interleaved_1f1b", R, M, V if V > 1 else None
    )
    split = models.split_layers(config.num_layers, num_stages)
    model = gpt.make_stages(config, split)
    mesh = jpipe.make_mesh(R, 1, jax.devices()[:R])
    pipe = jpipe.Pipeline(model.stages, schedule, mesh)
    params = jax.eval_shape(model.init, jax.random.key(0))
    pipe.packed_shapes(params)
    batch = {
        k: jax.ShapeDtypeStruct(
            (M * memory.MICROBATCH, config.seq_len), jnp.int32, sharding=pipe.batch_sharding
        )
        for k in ("tokens", "targets")
    }
    return pipe, params, batch, split


def split_figures(num_stages: int, config=memory.GPT2_SMALL, log=print) -> dict:
    """One split's entry of the profile (see the module docstring)."""
    pipe, params, batch, split = _pipeline(num_stages, config)
    kernels = pipe.stage_kernels(batch)
    classes = pipe.program(batch).classes

    def shapes(avals):
        return [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in avals]

    done: dict = {}
    for k, c in zip(kernels, classes):
        if c in done:
            continue
        res, carry = shapes(k.res_avals), shapes(k.carry_avals)
        y = shapes(jax.tree.leaves(k.y))
        act = _bytes(y) + (_bytes(jax.tree.leaves(k.x)) if k.has_x else 0)
        pieces = {
            "F": (k.forward, (k.params, k.x, k.inputs)),
            "I": (k.input_grad, (k.params, k.inputs, res, y)),
            "W": (k.weight_grad, (k.params, k.inputs, res, carry)),
        }
        flops, working = {}, 0
        for kind, (fn, args) in pieces.items():
            start = time.perf_counter()
            compiled = jax.jit(fn).lower(*args).compile()
            m = compiled.memory_analysis()
            working = max(working, m.temp_size_in_bytes + m.output_size_in_bytes)
            cost = compiled.cost_analysis()
            cost = cost[0] if isinstance(cost, list) else cost
            flops[kind] = float(cost.get("flops", 0.0))
            log(f"    S={num_stages} class {c} {kind}: {time.perf_counter() - start:.1f} s")
        done[c] = (flops, working + act)
    stage_params = [_bytes(jax.tree.leaves(p)) // 4 for p in params]  # float32: elements
    out_bytes = [_bytes(jax.tree.leaves(k.y)) for k in kernels]
    return {
        "stages": num_stages,
        "blocks_per_stage": list(split),
        "flops": {kind: [done[c][0][kind] for c in classes] for kind in ("F", "I", "W")}
        | {"recompute": [done[c][0]["F"] for c in classes]},
        "activation": [_bytes(k.res_avals) for k in kernels],
        "carry": [_bytes(k.carry_avals) for k in kernels],
        "output": out_bytes,
        "input": [0] + out_bytes[:-1],
        "params": [PARAM_BYTES * n for n in stage_params],
        "grad_output": [4 * n for n in stage_params],
        "working": [done[c][1] for c in classes],
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=OUT, help="where to write the profile")
    parser.add_argument("--stages", default="2,4,6,8,12", help="the stage counts to cut")
    args = parser.parse_args(argv)
    counts = [int(x) for x in args.stages.split(",") if x.strip()]
    c = memory.GPT2_SMALL
    splits = []
    for S in counts:
        start = time.perf_counter()
        print(f"S={S}", file=sys.stderr)
        splits.append(split_figures(S, log=lambda line: print(line, file=sys.stderr)))
        print(f"S={S}: {time.perf_counter() - start:.0f} s", file=sys.stderr)
    profile = {
        "format": "jpipe-stages/1",
        "model": (
            f"GPT-2 small ({c.num_layers} blocks, D {c.d_model}, {c.num_heads} heads, "
            f"L {c.seq_len}, vocabulary {c.vocab_size}, {c.dtype} compute, float32 parameters)"
        ),
        "microbatch_size": memory.MICROBATCH,
        "source": (
            "python -m bench.stage_profile: each stage's F, I and W pieces compiled alone from "
            f"shapes on XLA:CPU (jax {jax.__version__}), not run; FLOPs from cost_analysis(), "
            "bytes from the pieces' shapes and memory_analysis()"
        ),
        "rates": RATES,
        "rates_note": (
            "assumed, not measured: an H100 SXM at 40% of 989 TFLOP/s bf16, NVLink 4 at "
            "200 GB/s between ranks, 25 GB/s to pinned host memory"
        ),
        "splits": splits,
    }
    with open(args.out, "w") as f:
        json.dump(profile, f, indent=1)
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
