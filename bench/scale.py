"""Llama-3-8B at its real sizes, compiled from shapes: what each device holds.

``python -m bench.scale [--seq 4096] [--microbatches 8] [--variants V,...]``, for example
``--variants xla-none,blockwise-full+vocab+sequence``.

The full training step (AdamW, float32 parameters, bfloat16 compute, the
128,256-token vocabulary with ``remat_logits``) of Llama-3-8B (32 layers, D
4,096, FFN 14,336, 32 heads / 8 KV) on pipe 4 x tensor 2 (8 fake CPU
devices), 1F1B, one sequence per microbatch, is compiled, not run, once per
variant of the model's memory options: ``<attention>-<remat>`` (the
attention's implementation and the per-block rematerialization,
`jpipe.models.attention`), followed by ``+vocab`` for ``vocab_split`` (the
embedding and the head by vocabulary rows over ``tensor``, a cross-entropy
that never gathers the logits, `jpipe.models.vocab`) and ``+sequence`` for
``sequence_parallel`` (the activations between the split matmuls along the
sequence, `jpipe.models.sequence`). The state is
shape structs only, so nothing of the model is allocated. Each row is the
SPMD program's `memory_analysis()` per device: arguments (parameters, Adam
moments, the batch) and temp (everything else: residuals, the stash, the
working memory), and the compile's seconds.

Under the SPMD program every device holds the fullest rank's parameters,
so the arguments are the fullest rank's. One variant compiles in minutes and
takes several GB of host memory: run one at a time. docs/scale.md has the
table; ``python train.py --config=configs/llama3_8b.py
--config.compile_only=True`` checks the shipped config, either lowering.
"""

from __future__ import annotations

import jpipe

jpipe.use_cpu_devices(8)

import argparse  # noqa: E402
import json  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from bench.mesh_memory import _with_shardings, per_device_bytes  # noqa: E402
from jpipe import models  # noqa: E402
from jpipe.models import llama  # noqa: E402
from jpipe.train import optimizer as optimizer_lib  # noqa: E402
from jpipe.train import step as step_lib  # noqa: E402
from jpipe.train.config import OptimizerConfig  # noqa: E402

GB = 1e9
LLAMA3_8B = dict(
    vocab_size=128_256,
    num_layers=32,
    num_heads=32,
    num_kv_heads=8,
    d_model=4096,
    d_ff=14_336,
    rope_theta=500_000.0,
    dtype="bfloat16",
    remat_logits=True,
)
VARIANTS = (
    "xla-none",
    "blockwise-none",
    "blockwise-attention",
    "blockwise-dots",
    "blockwise-full",
    "blockwise-full+vocab",
    "blockwise-full+sequence",
    "blockwise-full+vocab+sequence",
)
SPLITS = {"vocab": "vocab_split", "sequence": "sequence_parallel"}


def model_config(variant: str, seq: int) -> models.LlamaConfig:
    """Llama-3-8B as `variant` (``<attention>-<remat>[+vocab][+sequence]``) says."""
    options, *splits = variant.split("+")
    attention, remat = options.split("-")
    unknown = set(splits) - set(SPLITS)
    if unknown:
        raise ValueError(f"variant {variant!r}: unknown split(s) {sorted(unknown)}; use {SPLITS}")
    return models.LlamaConfig(
        **LLAMA3_8B,
        seq_len=seq,
        attention=attention,
        remat=remat,
        **{SPLITS[name]: True for name in splits},
    )


def row(variant: str, seq: int, microbatches: int, pipe: int = 4, tensor: int = 2) -> dict:
    """One compiled step of Llama-3-8B with `variant` (`model_config`)."""
    config = model_config(variant, seq)
    mesh = jpipe.make_mesh(pipe, 1, jax.devices()[: pipe * tensor], tensor=tensor)
    schedule = jpipe.get_schedule("1f1b", pipe, microbatches)
    layers = models.split_layers(config.num_layers, schedule.num_stages)
    model = llama.make_stages(config, layers, tensor_axis="tensor")
    pipeline = jpipe.Pipeline(model.stages, schedule, mesh)
    params = jax.eval_shape(model.init, jax.random.key(0))
    packed = pipeline.packed_shapes(params, llama.tensor_specs(config, params))
    opt = OptimizerConfig(3e-4, 10, 0.1, 0.1, 0.9, 0.95, 1.0)  # AdamW, as configs/default.py
    optimizer = optimizer_lib.make_optimizer(opt, 100, optimizer_lib.packed_decay_rows(pipeline))
    lr = optimizer_lib.learning_rate_schedule(opt, 100)
    state = jax.eval_shape(
        lambda p: step_lib.TrainState(jnp.zeros((), jnp.int32), p, optimizer.init(p)), packed
    )
    state = _with_shardings(state, step_lib.state_shardings(state, pipeline))
    batch = {
        k: jax.ShapeDtypeStruct((microbatches, seq), jnp.int32, sharding=pipeline.batch_sharding)
        for k in ("tokens", "targets")
    }
    start = time.perf_counter()
    compiled = step_lib.compile_train_step(pipeline, optimizer, lr, state, batch)
    seconds = time.perf_counter() - start
    memory = compiled.memory_analysis()
    return {
        "variant": variant,
        "seq_len": seq,
        "microbatches": microbatches,
        "mesh": f"pipe {pipe} x tensor {tensor}",
        "param_bytes": per_device_bytes(state.params),
        "opt_bytes": per_device_bytes(state.opt_state),
        "argument_bytes": int(memory.argument_size_in_bytes),
        "temp_bytes": int(memory.temp_size_in_bytes),
        "compile_seconds": round(seconds, 1),
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--json", action="store_true", help="one JSON object a row")
    parser.add_argument(
        "--write-docs",
        action="store_true",
        help="also replace the table in docs/scale.md (block scale-seqSEQ-mM, or scale-splits "
        "with --variants)",
    )
    args = parser.parse_args(argv)
    table = [
        "| variant | arguments | temp | total a device | compile |",
        "|---|---:|---:|---:|---:|",
    ]
    print(f"Llama-3-8B, sequence {args.seq}, 1F1B, M {args.microbatches}, pipe 4 x tensor 2")
    print(f"{'variant':<30} {'arguments':>10} {'temp':>9} {'total':>9} {'compile':>8}")
    for variant in args.variants.split(","):
        r = row(variant, args.seq, args.microbatches)
        if args.json:
            print(json.dumps(r))
        total = r["argument_bytes"] + r["temp_bytes"]
        print(
            f"{variant:<30} {r['argument_bytes'] / GB:>8.1f} GB {r['temp_bytes'] / GB:>6.1f} GB "
            f"{total / GB:>6.1f} GB {r['compile_seconds']:>6.0f} s",
            flush=True,
        )
        table.append(
            f"| `{variant}` | {r['argument_bytes'] / GB:.2f} GB | {r['temp_bytes'] / GB:.2f} GB "
            f"| {total / GB:.2f} GB | {r['compile_seconds']:.0f} s |"
        )
    if args.write_docs:
        from bench import docs

        name = f"scale-seq{args.seq}-m{args.microbatches}"
        if args.variants != ",".join(VARIANTS):
            name = "scale-splits"
        docs.write("docs/scale.md", name, "\n".join(table), docs.command_line("bench.scale", argv))
        print(f"wrote block {name!r} of docs/scale.md")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
