"""What a device of an 8-GPU host holds for a 1.4B-parameter GPT: pipe, fsdp and tensor meshes.

``python -m bench.mesh_memory [--json] [--quick]``

For ``configs/gpt_1b_8gpu.py``'s model (GPT-3 XL's sizes: 24 blocks, D =
2,048, 16 heads, d_ff = 8,192, L = 1,024, GPT-2's 50,257-token vocabulary,
bfloat16 compute, float32 parameters) on 8 fake CPU devices, the full
training step with AdamW (`jpipe.train.step.compile_train_step`) is
compiled, not run, for each mesh of `MESHES`: pipe 8; pipe 4 (on 4 of the
devices, the control of the next two); pipe 4 x fsdp 2; pipe 4 x tensor 2;
pipe 2 x fsdp 2 x tensor 2 (the config's). The state is
shape structs only (`jax.eval_shape` of the optimizer's init on
`Pipeline.packed_shapes`, with `state_shardings`), so no array of the model is
made. Blocks are split evenly over the stages (`models.split_layers`), the
schedule is 1F1B with the config's M = 16, and every mesh runs microbatches
of `MICROBATCH` sequences per device row (per fsdp shard), so each device's
activations are alike.

Each row:

- ``param_bytes``, ``opt_bytes``: per device, from the shardings of the packed
  parameters and of the optimizer state's leaves (shard shape x itemsize,
  the largest device's sum).
- ``own_param_bytes``: the largest rank's own parameters, per device of that
  rank (each array's block as its sharding splits it, without the padding
  rows of the buckets); ``own_per_rank``: every rank's.
- ``temp_bytes``, ``argument_bytes``: the compiled step's `memory_analysis()`.
- ``need_bytes``: the largest rank's need, as `bench.memory.live_need`
  computes it from `Pipeline.stage_kernels`: the simulator's peak of
  residuals, carries and gradient accumulators (the accumulator as big as the
  rank's own parameters per device), plus the working memory of its largest
  piece (`bench.memory.piece_working_bytes`). Under tensor and fsdp the pieces
  are traced on one device's shapes, so the residuals are per device; the
  pieces see fsdp-gathered parameters; under tensor they are compiled in a
  `jax.shard_map` over the tensor devices, whose collectives they call.
  ``need_rank_param_bytes``: that rank's
  own parameter bytes per device; ``need_rank_peak_bytes``: its simulated
  peak alone (the need less the piece's working set); ``working_per_stage``:
  each stage's largest piece's working set.
- ``compile_seconds``: the step's lowering and compiling;
  ``piece_compile_seconds``: the pieces', compiled alone for the need.

``--quick`` runs a tiny GPT (8 blocks, D = 64): its bytes come in a second, but
each step still takes 10 to 20 s to compile on 2 cores (the program's size,
not the model's), so the test (tests/test_bench.py) reads every mesh's bytes
without compiling (`run(..., compile=False)`) and compiles one small mesh.
"""

from __future__ import annotations

import jpipe

# Before any JAX op: the meshes need 8 devices (`jax_num_cpu_devices`; kept if
# JAX has already started with as many, as under pytest).
jpipe.use_cpu_devices(8)

import argparse  # noqa: E402
import collections  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import pathlib  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from bench import docs  # noqa: E402
from bench.memory import live_need, piece_working_bytes  # noqa: E402
from jpipe import models  # noqa: E402
from jpipe.models import gpt  # noqa: E402
from jpipe.train import optimizer as optimizer_lib  # noqa: E402
from jpipe.train import step as step_lib  # noqa: E402
from jpipe.train.config import TrainConfig, config_from_file  # noqa: E402

CONFIG_FILE = pathlib.Path(__file__).resolve().parents[1] / "configs" / "gpt_1b_8gpu.py"
MICROBATCH = 4  # sequences per microbatch per device row (per fsdp shard)
# (pipe, fsdp, tensor); data 1 throughout. Pipe 4 alone is the control of
# pipe 4 x fsdp 2 and pipe 4 x tensor 2 (the same ranks, 4 devices).
MESHES = ((8, 1, 1), (4, 1, 1), (4, 2, 1), (4, 1, 2), (2, 2, 2))
QUICK = gpt.GPTConfig(
    vocab_size=512, seq_len=32, num_layers=8, num_heads=4, d_model=64, d_ff=256, dtype="bfloat16"
)
GIB = 2**30


def load_config():
    """``configs/gpt_1b_8gpu.py`` as a checked `TrainConfig` (its model and optimizer)."""
    return TrainConfig.from_config(config_from_file(CONFIG_FILE))


def per_device_bytes(structs) -> int:
    """The largest device's bytes of these sharded arrays or shape structs."""
    held: collections.Counter = collections.Counter()
    for leaf in jax.tree.leaves(structs):
        item = np.dtype(leaf.dtype).itemsize
        for device, index in leaf.sharding.devices_indices_map(tuple(leaf.shape)).items():
            held[device] += item * math.prod(
                len(range(*s.indices(n))) for s, n in zip(index, leaf.shape)
            )
    return max(held.values())


def _with_shardings(tree, shardings):
    return jax.tree.map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), tree, shardings
    )


def row(
    pipe: int,
    fsdp: int,
    tensor: int,
    config: gpt.GPTConfig,
    opt_config,
    M: int,
    compile: bool = True,
) -> dict:
    """One compiled mesh (see the module docstring).

    Without `compile`, only the bytes the shardings give (``param_bytes``,
    ``opt_bytes``, ``own_param_bytes``, ``own_per_rank``): no step is traced
    or compiled, which takes well under a second for a small model.
    """
    mesh = jpipe.make_mesh(pipe, 1, jax.devices()[: pipe * fsdp * tensor], fsdp=fsdp, tensor=tensor)
    schedule = jpipe.get_schedule("1f1b", pipe, M)
    layers = models.split_layers(config.num_layers, schedule.num_stages)
    tensor_axis = "tensor" if tensor > 1 else None
    model = gpt.make_stages(config, layers, tensor_axis=tensor_axis)
    pipeline = jpipe.Pipeline(model.stages, schedule, mesh)
    params = jax.eval_shape(model.init, jax.random.key(0))
    specs = gpt.tensor_specs(config, params) if tensor_axis else None
    packed = pipeline.packed_shapes(params, specs)
    optimizer = optimizer_lib.make_optimizer(
        opt_config, 100, optimizer_lib.packed_decay_rows(pipeline)
    )
    lr = optimizer_lib.learning_rate_schedule(opt_config, 100)
    state = jax.eval_shape(
        lambda p: step_lib.TrainState(jnp.zeros((), jnp.int32), p, optimizer.init(p)), packed
    )
    state = _with_shardings(state, step_lib.state_shardings(state, pipeline))
    rows = M * fsdp * MICROBATCH
    batch = {
        k: jax.ShapeDtypeStruct((rows, config.seq_len), jnp.int32, sharding=pipeline.batch_sharding)
        for k in ("tokens", "targets")
    }
    # Each stage's own bytes per device: every array's block as its bucket's sharding splits it.
    layout = pipeline.layout
    stage_bytes = [
        sum(math.prod(layout.local_shape(name)) * np.dtype(dt).itemsize for name, _, dt in leaves)
        for leaves in layout.leaves
    ]
    own = [0] * pipe
    for s, b in enumerate(stage_bytes):
        own[schedule.stage_to_rank[s]] += b
    rec = {
        "mesh": f"pipe {pipe} x fsdp {fsdp} x tensor {tensor}",
        "pipe": pipe,
        "fsdp": fsdp,
        "tensor": tensor,
        "layers_per_stage": list(layers),
        "microbatches": M,
        "batch_rows": rows,
        "param_bytes": per_device_bytes(state.params),
        "opt_bytes": per_device_bytes(state.opt_state),
        "own_param_bytes": max(own),
        "own_per_rank": own,
    }
    if not compile:
        return rec
    start = time.perf_counter()
    compiled = step_lib.compile_train_step(pipeline, optimizer, lr, state, batch)
    seconds = time.perf_counter() - start
    memory = compiled.memory_analysis()

    kernels = pipeline.stage_kernels(batch)
    # The pieces of a tensor-split stage sum over ``tensor`` themselves: compile
    # them on that axis's devices, each with one device's shapes.
    piece_mesh = (
        jax.sharding.Mesh(np.array(jax.devices()[:tensor]), ("tensor",)) if tensor_axis else None
    )
    start = time.perf_counter()
    working = piece_working_bytes(kernels, pipeline.program(batch).classes, piece_mesh)
    piece_seconds = time.perf_counter() - start
    need = live_need(schedule, kernels, stage_bytes, working)
    worst = int(np.argmax(need))
    # The need's parts: the simulator's peak (residuals, carries, gradient
    # accumulators) and the working set of the rank's largest piece.
    peak = live_need(schedule, kernels, stage_bytes, [0] * len(kernels))
    return {
        **rec,
        "temp_bytes": int(memory.temp_size_in_bytes),
        "argument_bytes": int(memory.argument_size_in_bytes),
        "need_bytes": max(need),
        "need_per_rank": need,
        "need_rank_param_bytes": own[worst],
        "need_rank_peak_bytes": peak[worst],
        "working_per_stage": working,
        "compile_seconds": round(seconds, 1),
        "piece_compile_seconds": round(piece_seconds, 1),
    }


def markdown(rows: list[dict]) -> str:
    """The table, in GiB per device."""

    def g(b):
        return f"{b / GIB:.2f}"

    lines = [
        "| mesh | blocks per stage | params GiB | largest rank's own params GiB | "
        "Adam state GiB | arguments GiB | temp GiB | need GiB (largest rank) | "
        "that rank's params GiB | temp / need | compile s |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['mesh']} | {','.join(map(str, r['layers_per_stage']))} | "
            f"{g(r['param_bytes'])} | {g(r['own_param_bytes'])} | {g(r['opt_bytes'])} | "
            f"{g(r['argument_bytes'])} | {g(r['temp_bytes'])} | {g(r['need_bytes'])} | "
            f"{g(r['need_rank_param_bytes'])} | {r['temp_bytes'] / r['need_bytes']:.2f}x | "
            f"{r['compile_seconds']:.0f} |"
        )
    return "\n".join(lines) + "\n"


def run(quick: bool = False, log=print, meshes=MESHES, compile: bool = True) -> list[dict]:
    """Every mesh of `meshes` (``(pipe, fsdp, tensor)``), for the config's model (quick: `QUICK`).

    Without `compile`, the rows hold only the bytes the shardings give (`row`).
    """
    c = load_config()
    config = QUICK if quick else c.model
    out = []
    for pipe, fsdp, tensor in meshes:
        if compile:
            log(f"compiling pipe {pipe} x fsdp {fsdp} x tensor {tensor} ...")
        start = time.perf_counter()
        rec = row(pipe, fsdp, tensor, config, c.optimizer, c.num_microbatches, compile)
        line = (
            f"  {rec['mesh']}: params {rec['param_bytes'] / GIB:.3f} GiB, Adam state "
            f"{rec['opt_bytes'] / GIB:.3f} GiB"
        )
        if compile:
            line += (
                f", temp {rec['temp_bytes'] / GIB:.2f} GiB, need {rec['need_bytes'] / GIB:.2f} "
                f"GiB; step compiled in {rec['compile_seconds']:.0f} s, pieces in "
                f"{rec['piece_compile_seconds']:.0f} s, row in {time.perf_counter() - start:.0f} s"
            )
        log(line)
        out.append(rec)
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print one JSON list of rows")
    parser.add_argument(
        "--quick", action="store_true", help="a tiny GPT (each compile still 10-20 s)"
    )
    docs.add_flag(parser, DOCS_PAGE)
    args = parser.parse_args(argv)
    log = (lambda *a: print(*a, file=sys.stderr, flush=True)) if args.json else print
    log(f"jax {jax.__version__}, {len(jax.devices())} {jax.devices()[0].platform} devices")
    rows = run(args.quick, log)
    if args.json:
        print(json.dumps(rows))
    else:
        print(markdown(rows), end="")
    if args.write_docs:
        docs.write(
            DOCS_PAGE, "mesh-memory", markdown(rows), docs.command_line("bench.mesh_memory", argv)
        )
    return 0


DOCS_PAGE = "docs/compiler-measurements.md"


if __name__ == "__main__":
    sys.exit(main())
