"""``python -m bench.gpu``: a GPT through both lowerings, and the attention kernels.

The check to run the day a GPU is lent (issues 22 and 35). Two tables. The
first has one row per way of computing the loss and gradients of the same
GPT on the same global batch:

- ``plain``: `jax.jit` of `jax.value_and_grad` of the model on the whole
  batch, on one device, no pipeline;
- ``spmd``: `jpipe.Pipeline` with the SPMD lowering, default XLA flags;
- ``spmd+cmdbuf``: the same with ``--xla_gpu_enable_command_buffer=+CONDITIONAL``
  (the tick conditionals recorded into CUDA graphs); on anything but a GPU
  the flag means nothing and the rows say ``skipped: not a GPU``;
- ``mpmd``: `jpipe.Pipeline` with ``lowering="mpmd"`` (one program per
  piece, issued from the host; the row also gives the host operations a step
  issues and how long issuing them took, from `RankPrograms.last_run`);

the pipeline rows for each schedule (1F1B and ZB-H1 by default).

Step time: the median of ``--reps`` steps after ``--warmup`` steps, each
waited for with `jax.block_until_ready` (loss and every gradient). A step is
loss and gradients only, no optimizer. MFU: the model's FLOPs per step, ``6 *
N * tokens + 12 * layers * seq_len * d_model * tokens`` (N the parameters
that multiply: all but the token and position tables, which are looked up;
the second term is attention's, PaLM's appendix B), divided by the step
time and by the peak dense bf16 FLOP/s of the devices the row uses
(`PEAK_BF16` by ``device_kind``; ``n/a`` for a kind it does not know, such
as ``cpu``). The plain model's XLA ``cost_analysis()`` FLOPs are printed
beside it as a cross-check.

Devices: with 2 to 4 devices the pipeline has ``pipe`` = all of them; with 8
or more, ``pipe=4`` and ``data`` = the rest (a multiple of 4 devices); with
5 to 7, ``pipe=4`` on the first four (``--pipe`` and ``--data`` override).
With one GPU nothing can overlap, so the pipeline rows run with ``pipe=1``
(every stage on that device, one stage) and measure each lowering's cost
over the plain model, not pipelining; the table says so. On a CPU the
check fakes 2 devices unless ``XLA_FLAGS`` asks for a count.

The second table is what a CPU cannot show of issue 35's attention: one row
per sequence length and implementation of
`jpipe.models.attention.causal_attention` (``xla``, the scores
materialized; ``blockwise``, flash-style in plain JAX, tile
``--attention-block``, `LlamaConfig`'s 512 on a GPU; ``cudnn``, the GPU's
fused kernel), for one causal attention of Llama-3-8B's shape
(`ATTENTION_SHAPE`: batch 1, 32 query heads, 8 key/value heads of 128, bf16;
standard normal inputs). Each row times the forward and backward (the output
and the gradients of q, k and v for a fixed cotangent, one jitted program;
the median of ``--reps`` after ``--warmup``, as above) and gives its TFLOP/s
(`attention_flops`), XLA's temporary bytes for the program
(``memory_analysis()``, where the backend has it), and the largest absolute
difference of its output and gradients from the ``xla`` row's at the same
length. On a GPU the lengths are 2,048 and 8,192 (``--size small``);
anywhere else they shrink to 512, so that the dense rows take seconds, and
the ``cudnn`` row says ``skipped: not a GPU``. ``--attention-lengths`` sets
them; ``--only gpt`` or ``--only attention`` runs one table.

XLA reads ``XLA_FLAGS`` once, when its backend starts, so each set of flags
runs in its own process: this module, started with ``--worker``, runs one
group of rows (the attention table is a group of its own, after the GPT's)
and prints each as a JSON line; the process without
``--worker`` (which never starts a backend, leaving the devices to the
workers) runs the workers one after another, within ``--budget`` seconds in
all, and prints the tables. ``--out`` gets them as JSON (the attention's
under ``"attention"``).
"""

from __future__ import annotations

import argparse
import datetime
import functools
import gc
import json
import os
import platform
import shlex
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MARK = "@@bench.gpu "  # a worker's JSON lines start with this
CMDBUF_FLAG = "--xla_gpu_enable_command_buffer=+CONDITIONAL"
VARIANTS = ("plain", "spmd", "spmd+cmdbuf", "mpmd")
DEFAULT_SCHEDULES = ("1f1b", "zb_h1")

# Peak dense (not sparse) bf16 FLOP/s per device, by a substring of
# `device_kind` (first match wins, so the more specific kinds come first).
PEAK_BF16 = (
    ("H100 PCIe", 756e12),
    ("H100 NVL", 835e12),
    ("H100", 989e12),
    ("H200", 989e12),
    ("GH200", 989e12),
    ("H800", 989e12),
    ("A100", 312e12),
    ("A800", 312e12),
    ("L40S", 362e12),
    ("L40", 181e12),
    ("L4", 121e12),
    ("TPU v4", 275e12),
    ("TPU v5 lite", 197e12),
    ("TPU v5e", 197e12),
    ("TPU v5p", 459e12),
    ("TPU v5", 459e12),
    ("TPU v6", 918e12),
)


def peak_flops(device_kind: str) -> float | None:
    """The device's peak dense bf16 FLOP/s, or None for a kind not in `PEAK_BF16`."""
    kind = device_kind.lower()
    for name, peak in PEAK_BF16:
        if name.lower() in kind:
            return peak
    return None


# The sizes: a GPT config (as keyword arguments), microbatch rows and count, reps.
SIZES = {
    "small": {  # GPT-2 small widths (vocabulary padded to 50304), bf16 compute
        "config": dict(
            vocab_size=50304,
            seq_len=1024,
            num_layers=12,
            num_heads=12,
            d_model=768,
            d_ff=3072,
            dtype="bfloat16",
        ),
        "microbatch_size": 4,
        "microbatches": 8,
        "reps": 10,
        "warmup": 2,
        # The attention section's (sequence lengths, blockwise tile): on a GPU,
        # and on anything else (where 8,192 tokens of dense scores take minutes).
        "attention": {"gpu": ((2048, 8192), 512), "other": ((512,), 128)},
    },
    "tiny": {  # for the CPU test: seconds, not minutes
        "config": dict(
            vocab_size=64,
            seq_len=16,
            num_layers=4,
            num_heads=2,
            d_model=32,
            d_ff=64,
            dtype="bfloat16",
        ),
        "microbatch_size": 2,
        "microbatches": 4,
        "reps": 3,
        "warmup": 1,
        "attention": {"gpu": ((256,), 64), "other": ((64,), 16)},
    },
}

# The attention section's shape: one layer of Llama-3-8B (`LlamaConfig`'s
# 32 query heads, 8 key/value heads of 128), one sequence, bf16.
ATTENTION_SHAPE = {"batch": 1, "heads": 32, "kv_heads": 8, "head_dim": 128}
ATTENTION_DTYPE = "bfloat16"
PARTS = ("gpt", "attention")


def _names(text: str) -> tuple[str, ...]:
    return tuple(v.strip() for v in text.split(",") if v.strip())


def _lengths(text: str) -> tuple[int, ...]:
    try:
        lengths = tuple(int(v) for v in _names(text))
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a list of lengths: {text!r}") from None
    if not lengths or min(lengths) < 1:
        raise argparse.ArgumentTypeError(f"lengths must be positive: {text!r}")
    return lengths


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m bench.gpu",
        description="Step time and MFU of a GPT: plain jit, the SPMD lowering (default flags "
        "and with conditional command buffers) and the per-rank lowering, per schedule; then "
        "the time and memory of Llama-3-8B's attention under each implementation.",
    )
    p.add_argument("--size", choices=tuple(SIZES), default="small", help="model size (small)")
    p.add_argument(
        "--out", default="runs/bench_gpu.json", help="the table as JSON (runs/bench_gpu.json)"
    )
    p.add_argument(
        "--schedules",
        type=_names,
        default=DEFAULT_SCHEDULES,
        help=f"schedules with one stage per rank ({','.join(DEFAULT_SCHEDULES)})",
    )
    p.add_argument("--microbatches", type=int, help="microbatches a step (small 8, tiny 4)")
    p.add_argument("--microbatch-size", type=int, help="rows a microbatch (small 4, tiny 2)")
    p.add_argument("--reps", type=int, help="timed steps a row (small 10, tiny 3)")
    p.add_argument("--warmup", type=int, help="untimed steps first, at least 1 (small 2, tiny 1)")
    p.add_argument("--pipe", type=int, help="pipeline ranks (default: from the devices)")
    p.add_argument("--data", type=int, help="data-parallel ways (default: from the devices)")
    p.add_argument(
        "--budget",
        type=float,
        default=450.0,
        help="seconds for every worker together (450); a worker past it is stopped",
    )
    p.add_argument(
        "--only", choices=PARTS, help="run only the GPT table or only the attention table"
    )
    p.add_argument(
        "--attention-lengths",
        type=_lengths,
        help="the attention rows' sequence lengths (small: 2048,8192 on a GPU, else 512)",
    )
    p.add_argument(
        "--attention-block",
        type=int,
        help="the blockwise attention's tile (small: 512 on a GPU, else 128)",
    )
    p.add_argument(
        "--worker", choices=("spmd", "cmdbuf", "mpmd", "attention"), help=argparse.SUPPRESS
    )
    return p


def settle(args: argparse.Namespace) -> argparse.Namespace:
    size = SIZES[args.size]
    for key in ("microbatches", "microbatch_size", "reps", "warmup"):
        if getattr(args, key) is None:
            setattr(args, key, size[key])
    if args.microbatches < 1 or args.microbatch_size < 1 or args.reps < 1 or args.warmup < 0:
        raise SystemExit("--microbatches, --microbatch-size and --reps must be at least 1")
    if not args.schedules:
        raise SystemExit("--schedules names none")
    if args.attention_block is not None and args.attention_block < 1:
        raise SystemExit(f"--attention-block must be at least 1, got {args.attention_block}")
    return args


# -- the workers (each its own process, its own XLA_FLAGS) ------------------------------


_STARTED = time.monotonic()


def _emit(record: dict) -> None:
    if record.get("kind") in ("row", "attention"):
        what = (
            " ".join(filter(None, [record["variant"], record["schedule"]]))
            if record["kind"] == "row"
            else f"attention {record['implementation']} L={record['seq_len']}"
        )
        step = record.get("step_seconds")
        _log(
            f"{what}: {record.get('status')}"
            + (f", {step * 1e3:.1f} ms a step" if step else "")
            + f" ({time.monotonic() - _STARTED:.0f}s into the worker)"
        )
    print(MARK + json.dumps(record), flush=True)


def _log(*parts) -> None:
    print(*parts, file=sys.stderr, flush=True)


def _error(e: BaseException) -> str:
    return f"error: {type(e).__name__}: {e}".splitlines()[0][:300]


def layout(devices, pipe: int | None, data: int | None) -> tuple[int, int, str]:
    """``(pipe, data, note)`` for these devices (see the module docstring)."""
    n, kind = len(devices), devices[0].device_kind
    if pipe is not None or data is not None:
        pipe, data = pipe or max(1, n // (data or 1)), data or 1
        if pipe * data > n:
            raise SystemExit(f"--pipe {pipe} x --data {data} needs {pipe * data} devices, have {n}")
        return pipe, data, f"pipe={pipe} x data={data} as asked, of {n} {kind} device(s)"
    if n == 1:
        return (
            1,
            1,
            f"one {kind} device: a pipeline needs 2 or more to overlap its ranks, so the "
            "pipeline rows run with pipe=1 (one stage, the whole model on that device) and "
            "measure each lowering's cost over the plain model, not pipelining",
        )
    if n <= 4:
        return n, 1, f"pipe={n} over all {n} {kind} devices"
    if n % 4 == 0:
        return 4, n // 4, f"pipe=4 x data={n // 4} over all {n} {kind} devices"
    return 4, 1, f"pipe=4 on 4 of the {n} {kind} devices"


def _time_steps(step, warmup: int, reps: int, after=None) -> tuple[float, list[float], list]:
    """The first step's loss, then `reps` timed steps' seconds (and `after()` of each)."""
    import jax

    loss = float(jax.block_until_ready(step())[0])
    for _ in range(max(0, warmup - 1)):
        jax.block_until_ready(step())
    times, extra = [], []
    gc.collect()
    for _ in range(reps):
        start = time.perf_counter()
        jax.block_until_ready(step())
        times.append(time.perf_counter() - start)
        if after is not None:
            extra.append(after())
    return loss, times, extra


def _timing(times: list[float]) -> dict:
    return {
        "step_seconds": float(statistics.median(times)),
        "best_seconds": float(min(times)),
        "times": [float(t) for t in times],
    }


def _xla_flops(compiled) -> float | None:
    try:
        cost = compiled.cost_analysis()
    except Exception:  # not every backend or version has it
        return None
    if isinstance(cost, (list, tuple)):
        cost = cost[0] if cost else None
    flops = (cost or {}).get("flops")
    return float(flops) if flops else None


def model_flops(config, params) -> tuple[int, float]:
    """``(parameters, FLOPs per token)`` of a training step (see the module docstring)."""
    from jpipe.models import gpt

    total = gpt.num_params(params)
    lookups = (config.vocab_size + config.seq_len) * config.d_model  # token, position tables
    attention = 12 * config.num_layers * config.seq_len * config.d_model
    return total, 6.0 * (total - lookups) + attention


def _plain_row(args, whole, params_host, batch_host, device, record: dict) -> None:
    """Fills `record` with the plain jitted model's figures, on one device."""
    import jax

    params = jax.device_put(params_host, device)
    batch = jax.device_put(batch_host, device)
    start = time.perf_counter()
    compiled = jax.jit(jax.value_and_grad(whole.loss)).lower(params, batch).compile()
    record["compile_seconds"] = time.perf_counter() - start
    record["xla_flops"] = _xla_flops(compiled)
    loss, times, _ = _time_steps(lambda: compiled(params, batch), args.warmup, args.reps)
    record.update(status="ok", loss=loss, **_timing(times))


def _pipeline_row(args, model, params, sched, mesh, lowering, batch_host, record: dict) -> None:
    """Fills `record` with one pipeline's figures (host ops too, for the per-rank lowering)."""
    import jax

    import jpipe

    pipeline = jpipe.Pipeline(model.stages, sched, mesh, lowering=lowering)
    packed = pipeline.pack(params)
    batch = jax.device_put(batch_host, pipeline.batch_sharding)
    compiled = pipeline.compile(packed, batch)  # RankPrograms under mpmd
    record["compile_seconds"] = pipeline.compile_seconds
    record["stages"] = sched.num_stages
    if lowering == "mpmd":
        loss, times, runs = _time_steps(
            lambda: pipeline.value_and_grad(packed, batch),
            args.warmup,
            args.reps,
            after=lambda: dict(compiled.last_run),
        )
        ops = [r["host_ops"] for r in runs if r.get("host_ops") is not None]
        issue = [r["seconds"] for r in runs if r.get("seconds") is not None]
        record["host_ops"] = ops[-1] if ops else None
        record["issue_seconds"] = float(statistics.median(issue)) if issue else None
    else:
        record["ticks"] = pipeline.tick_plan.num_ticks
        loss, times, _ = _time_steps(lambda: compiled(packed, batch), args.warmup, args.reps)
    record.update(status="ok", loss=loss, **_timing(times))


def _attempt(fill, record: dict, *fill_args) -> None:
    """Runs ``fill(*fill_args, record)``; a failure becomes the row's status."""
    try:
        fill(*fill_args, record)
    except Exception as e:
        record["status"] = _error(e)
        if os.environ.get("BENCH_DEBUG"):
            import traceback

            traceback.print_exc()


def _guarded(fill, record: dict, *fill_args) -> None:
    """`_attempt`, then emits the row."""
    _attempt(fill, record, *fill_args)
    _emit(record)
    gc.collect()  # the row's arrays go before the next row allocates


# -- the attention section (a worker of its own) -------------------------------------------

# `jpipe.models.attention.IMPLEMENTATIONS`, named here so that the orchestrator
# need not import JAX (tests/test_bench_gpu.py checks they agree).
ATTENTION_IMPLEMENTATIONS = ("xla", "blockwise", "cudnn")
ATTENTION_RESULTS = ("out", "dq", "dk", "dv")  # what one attention step returns


def attention_plan(args: argparse.Namespace, gpu: bool) -> tuple[tuple[int, ...], int]:
    """``(sequence lengths, blockwise tile)`` of the attention rows on this platform."""
    lengths, block = SIZES[args.size]["attention"]["gpu" if gpu else "other"]
    return args.attention_lengths or lengths, args.attention_block or block


def attention_flops(seq_len: int) -> float:
    """FLOPs of one causal attention's forward and backward, as FlashAttention-2 counts them.

    ``4 B H L^2 K`` for the forward's two products, halved by the causal mask;
    the backward's five products are 2.5 times that. The ``"xla"`` row
    computes the masked half too: its TFLOP/s count only the useful half.
    """
    shape = ATTENTION_SHAPE
    forward = 4.0 * shape["batch"] * shape["heads"] * seq_len**2 * shape["head_dim"] / 2
    return 3.5 * forward


def _attention_inputs(seq_len: int, seed: int = 0) -> tuple:
    """``q, k, v`` and the output's cotangent: standard normal, in `ATTENTION_DTYPE`."""
    import jax

    shape = ATTENTION_SHAPE
    b, h, g, k = shape["batch"], shape["heads"], shape["kv_heads"], shape["head_dim"]
    keys = jax.random.split(jax.random.key(seed), 4)
    sizes = ((b, seq_len, h, k), (b, seq_len, g, k), (b, seq_len, g, k), (b, seq_len, h, k))
    return tuple(jax.random.normal(key, size, ATTENTION_DTYPE) for key, size in zip(keys, sizes))


def _attention_step(q, k, v, d_out, *, implementation: str, block: int):
    """jpipe's causal attention forward and backward: the output, then dq, dk and dv."""
    import jax

    from jpipe.models.attention import causal_attention

    out, vjp = jax.vjp(lambda q, k, v: causal_attention(q, k, v, implementation, block), q, k, v)
    return (out, *vjp(d_out))


def _temp_bytes(compiled) -> int | None:
    try:
        stats = compiled.memory_analysis()
    except Exception:  # not every backend or version has it
        return None
    temp = getattr(stats, "temp_size_in_bytes", None)
    return None if temp is None else int(temp)


def _attention_row(implementation, block, inputs, reps, warmup, reference, record) -> None:
    """Fills `record` with one implementation's time, memory and difference from ``"xla"``.

    `reference`: the ``"xla"`` row's results at this length (a list the
    ``"xla"`` row fills; empty if it failed).
    """
    import jax
    import jax.numpy as jnp

    step = jax.jit(functools.partial(_attention_step, implementation=implementation, block=block))
    start = time.perf_counter()
    compiled = step.lower(*inputs).compile()
    record["compile_seconds"] = time.perf_counter() - start
    record["temp_bytes"] = _temp_bytes(compiled)
    results = jax.block_until_ready(compiled(*inputs))
    for _ in range(max(0, warmup - 1)):
        jax.block_until_ready(compiled(*inputs))
    times = []
    gc.collect()
    for _ in range(reps):
        start = time.perf_counter()
        jax.block_until_ready(compiled(*inputs))
        times.append(time.perf_counter() - start)
    record.update(_timing(times))
    record["tflops"] = record["flops"] / record["step_seconds"] / 1e12
    if implementation == "xla":
        reference[:] = results
        record["abs_max"] = {
            name: float(jnp.abs(x.astype(jnp.float32)).max())
            for name, x in zip(ATTENTION_RESULTS, results)
        }
    elif reference:
        record["diff_vs_xla"] = {
            name: float(jnp.abs(x.astype(jnp.float32) - r.astype(jnp.float32)).max())
            for name, x, r in zip(ATTENTION_RESULTS, results, reference)
        }
    record["status"] = "ok"


def attention_rows(lengths, block: int, reps: int, warmup: int):
    """Yields the attention section's records, one per length and implementation, filled in.

    Runs in this process, on its first device; ``"cudnn"`` only where that is
    a GPU (elsewhere JAX refuses it), its row saying so.
    """
    import jax

    device = jax.devices()[0]
    for seq_len in lengths:
        inputs = jax.device_put(_attention_inputs(seq_len), device)
        reference: list = []
        for implementation in ATTENTION_IMPLEMENTATIONS:
            record = {
                "kind": "attention",
                "implementation": implementation,
                "seq_len": seq_len,
                "block": block if implementation == "blockwise" else None,
                "platform": device.platform,
                "device_kind": device.device_kind,
                "flops": attention_flops(seq_len),
            }
            if implementation == "cudnn" and device.platform != "gpu":
                record["status"] = "skipped: not a GPU"
            else:
                _attempt(
                    _attention_row, record, implementation, block, inputs, reps, warmup, reference
                )
            yield record
        del inputs, reference
        gc.collect()


def attention_worker(args: argparse.Namespace) -> int:
    """Runs the attention section in this process, printing each record as a JSON line."""
    import jax

    device = jax.devices()[0]
    lengths, block = attention_plan(args, device.platform == "gpu")
    _emit(
        {
            "kind": "attention_env",
            "platform": device.platform,
            "device_kind": device.device_kind,
            "jax": jax.__version__,
            "lengths": list(lengths),
            "block": block,
        }
    )
    _log(f"attention on {device.device_kind} ({device.platform}): L in {lengths}, tile {block}")
    for record in attention_rows(lengths, block, args.reps, args.warmup):
        _emit(record)
        gc.collect()
    return 0


def worker(args: argparse.Namespace) -> int:
    """Runs one group of rows in this process, printing each as a JSON line."""
    if args.worker == "attention":
        return attention_worker(args)
    if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
        import jpipe

        jpipe.use_cpu_devices(2)  # only the CPU backend reads it; harmless on a GPU
    import jax
    import numpy as np

    import jpipe
    from jpipe.models import gpt
    from jpipe.models.staged import split_layers

    devices = jax.devices()
    kind, backend = devices[0].device_kind, devices[0].platform
    pipe, data, note = layout(devices, args.pipe, args.data)
    config = gpt.GPTConfig(**SIZES[args.size]["config"])
    rows = args.microbatch_size * args.microbatches
    batch_host = gpt.example_batch(config, rows)
    tokens = rows * config.seq_len
    _emit(
        {
            "kind": "env",
            "platform": backend,
            "device_kind": kind,
            "num_devices": len(devices),
            "pipe": pipe,
            "data": data,
            "note": note,
            "jax": jax.__version__,
            "xla_flags": os.environ.get("XLA_FLAGS", ""),
            "tokens": tokens,
        }
    )
    _log(f"{note}; XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}")

    if args.worker == "spmd":
        whole = gpt.make_stages(config, (config.num_layers,))
        params_host = jax.tree.map(np.asarray, whole.init(0))
        num_params, per_token = model_flops(config, params_host)
        record = {"kind": "row", "variant": "plain", "schedule": None, "devices": 1}
        record.update(mesh="1 device", num_params=num_params, model_flops=per_token * tokens)
        _guarded(_plain_row, record, args, whole, params_host, batch_host, devices[0])
        del params_host

    lowering = "mpmd" if args.worker == "mpmd" else "spmd"
    variant = {"spmd": "spmd", "cmdbuf": "spmd+cmdbuf", "mpmd": "mpmd"}[args.worker]
    mesh = jpipe.make_mesh(pipe, data, devices[: pipe * data])
    models: dict = {}
    for name in args.schedules:
        record = {"kind": "row", "variant": variant, "schedule": name, "devices": pipe * data}
        record["mesh"] = f"pipe={pipe} x data={data}"
        try:
            sched = jpipe.get_schedule(name, pipe, args.microbatches)
            layers = split_layers(config.num_layers, sched.num_stages)
            if layers not in models:  # every cut starts from the same weights (gpt's init)
                model = gpt.make_stages(config, layers)
                models[layers] = model, model.init(0)
        except Exception as e:
            record["status"] = _error(e)
            _emit(record)
            continue
        model, params = models[layers]
        num_params, per_token = model_flops(config, params)
        record.update(num_params=num_params, model_flops=per_token * tokens)
        _guarded(_pipeline_row, record, args, model, params, sched, mesh, lowering, batch_host)
    return 0


# -- the orchestrator (never starts a backend) --------------------------------------------


def _expected(worker_name: str, schedules) -> list[tuple[str, str | None]]:
    variant = {"spmd": "spmd", "cmdbuf": "spmd+cmdbuf", "mpmd": "mpmd"}[worker_name]
    rows = [("plain", None)] if worker_name == "spmd" else []
    return rows + [(variant, s) for s in schedules]


def _worker_argv(args: argparse.Namespace, name: str) -> list[str]:
    argv = [sys.executable, "-m", "bench.gpu", "--worker", name, "--size", args.size]
    argv += ["--schedules", ",".join(args.schedules)]
    for flag in ("microbatches", "microbatch_size", "reps", "warmup", "pipe", "data"):
        value = getattr(args, flag)
        if value is not None:
            argv += ["--" + flag.replace("_", "-"), str(value)]
    if args.attention_lengths:
        argv += ["--attention-lengths", ",".join(map(str, args.attention_lengths))]
    if args.attention_block is not None:
        argv += ["--attention-block", str(args.attention_block)]
    return argv


def run_worker(args, name: str, extra_flags: str, timeout: float) -> tuple[list[dict], str | None]:
    """Runs one worker; returns its JSON records and, if it failed, why."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    if extra_flags:
        env["XLA_FLAGS"] = " ".join(filter(None, [env.get("XLA_FLAGS", ""), extra_flags]))
    argv = _worker_argv(args, name)
    print(f"bench.gpu: worker {name}: {shlex.join(argv[1:])}", file=sys.stderr, flush=True)
    proc = subprocess.Popen(
        argv,
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # its own process group, to stop it whole
    )
    records: list[dict] = []
    tail: list[str] = []

    def read():
        for line in proc.stdout:
            if line.startswith(MARK):
                records.append(json.loads(line[len(MARK) :]))
            else:
                sys.stderr.write(f"  [{name}] {line}")
                tail[:] = (tail + [line.strip()])[-5:]

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    why = None
    try:
        rc = proc.wait(timeout=max(1.0, timeout))
        if rc != 0:
            last = next((t for t in reversed(tail) if t), "")
            why = f"error: worker exited with {rc}" + (f": {last[:200]}" if last else "")
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        why = f"error: stopped after {timeout:.0f}s (the --budget)"
    reader.join(timeout=10)
    return records, why


def orchestrate(args: argparse.Namespace) -> dict:
    start = time.monotonic()
    deadline = start + args.budget
    env: dict | None = None
    rows: dict[tuple, dict] = {}
    attention_env: dict | None = None
    attention: dict[tuple, dict] = {}

    def collect(name, records, why):
        nonlocal env, attention_env
        for rec in records:
            if rec.get("kind") == "env":
                env = env or rec
            elif rec.get("kind") == "attention_env":
                attention_env = rec
            elif rec.get("kind") == "attention":
                attention[(rec["seq_len"], rec["implementation"])] = rec
            else:
                rows[(rec["variant"], rec["schedule"])] = rec
        if name == "attention":
            # The lengths come from the worker's platform; without its word, from
            # the GPT workers' (None if neither spoke).
            lengths = (
                attention_env["lengths"]
                if attention_env
                else attention_plan(args, _gpu(env))[0]
                if env or args.attention_lengths
                else [None]
            )
            for seq_len in lengths:
                for implementation in ATTENTION_IMPLEMENTATIONS:
                    attention.setdefault(
                        (seq_len, implementation),
                        {
                            "implementation": implementation,
                            "seq_len": seq_len,
                            "status": why or "error: no result",
                        },
                    )
            return
        for variant, schedule in _expected(name, args.schedules):
            rows.setdefault(
                (variant, schedule),
                {"variant": variant, "schedule": schedule, "status": why or "error: no result"},
            )

    plan = ["spmd", "cmdbuf", "mpmd"] if args.only in (None, "gpt") else []
    if args.only in (None, "attention"):
        plan.append("attention")
    for i, name in enumerate(plan):
        if name == "cmdbuf" and not _gpu(env):
            # XLA_FLAGS' GPU flags mean nothing to another backend: no run to make.
            collect(name, [], "skipped: not a GPU" if env else "skipped: no device facts")
            continue
        left = deadline - time.monotonic()
        if left < 5:
            collect(name, [], "skipped: the --budget was spent")
            continue
        # Leave each worker still to come a minute at least.
        later = sum(1 for n in plan[i + 1 :] if n != "cmdbuf" or _gpu(env) or env is None)
        timeout = max(min(left, 30.0), left - 60.0 * later)
        records, why = run_worker(args, name, CMDBUF_FLAG if name == "cmdbuf" else "", timeout)
        collect(name, records, why)

    env = env or {}
    peak = peak_flops(env.get("device_kind", "")) if env else None
    plain = rows.get(("plain", None), {})
    # Every row that got as far as its model says the same (its parameters are the same).
    flops = next((r["model_flops"] for r in rows.values() if r.get("model_flops")), None)
    for rec in rows.values():
        if rec.get("step_seconds") and flops and peak:
            rec["mfu"] = flops / rec["step_seconds"] / (peak * rec.get("devices", 1))
        else:
            rec["mfu"] = None
        if rec.get("loss") is not None and plain.get("loss"):
            rec["loss_rel_diff"] = abs(rec["loss"] - plain["loss"]) / abs(plain["loss"])
    order = [("plain", None)] + [(v, s) for v in VARIANTS[1:] for s in args.schedules]
    result = {
        "meta": {
            "command": "python -m bench.gpu " + shlex.join(sys.argv[1:]),
            "size": args.size,
            "config": SIZES[args.size]["config"],
            "microbatches": args.microbatches,
            "microbatch_size": args.microbatch_size,
            "reps": args.reps,
            "warmup": args.warmup,
            "platform": env.get("platform"),
            "device_kind": env.get("device_kind"),
            "num_devices": env.get("num_devices"),
            "pipe": env.get("pipe"),
            "data": env.get("data"),
            "devices_note": env.get("note"),
            "peak_bf16_flops": peak,
            "model_flops": flops,
            "xla_flops_plain": plain.get("xla_flops"),
            "tokens": env.get("tokens"),
            "num_params": next(
                (r["num_params"] for r in rows.values() if r.get("num_params")), None
            ),
            "jax": env.get("jax"),
            "xla_flags": env.get("xla_flags"),
            "cmdbuf_flag": CMDBUF_FLAG,
            "host": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
            "date": datetime.datetime.now().isoformat(timespec="seconds"),
            "wall_seconds": time.monotonic() - start,
        },
        "rows": [rows[key] for key in order if key in rows],
    }
    if "attention" in plan:
        where = attention_env or {}
        result["attention"] = {
            "meta": {
                **ATTENTION_SHAPE,
                "dtype": ATTENTION_DTYPE,
                "lengths": where.get("lengths"),
                "gpu_lengths": list(attention_plan(args, True)[0]),
                "block": where.get("block"),
                "reps": args.reps,
                "warmup": args.warmup,
                "platform": where.get("platform"),
                "device_kind": where.get("device_kind"),
                "jax": where.get("jax"),
            },
            "rows": [
                attention[key]
                for key in sorted(
                    attention,
                    key=lambda k: (k[0] or 0, ATTENTION_IMPLEMENTATIONS.index(k[1])),
                )
            ],
        }
    return result


def _gpu(env) -> bool:
    return env is not None and env.get("platform") == "gpu"


def _ms(seconds) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.1f}"


def table(result: dict) -> str:
    """The tables as Markdown, each with a few lines of context above it."""
    parts = [gpt_table(result)] if result["rows"] else []
    if "attention" in result:
        parts.append(attention_table(result["attention"]))
    return "\n\n".join(parts)


def gpt_table(result: dict) -> str:
    """The GPT rows' table as Markdown, with a few lines of context above it."""
    meta = result["meta"]
    peak = meta["peak_bf16_flops"]
    lines = [
        f"bench.gpu --size {meta['size']}: GPT {meta['config']['num_layers']} blocks, "
        f"D={meta['config']['d_model']}, L={meta['config']['seq_len']}, "
        f"vocab {meta['config']['vocab_size']}, {meta['config']['dtype']} compute; "
        f"{meta['microbatches']} microbatches x {meta['microbatch_size']} rows "
        f"({meta['tokens']} tokens a step); median of {meta['reps']} steps after "
        f"{meta['warmup']} warm-up",
        f"devices: {meta['devices_note']} (jax {meta['jax']})",
        "model FLOPs a step: "
        + (f"{meta['model_flops']:.4g}" if meta["model_flops"] else "n/a")
        + " (6 N tokens + attention); XLA cost analysis of plain: "
        + (f"{meta['xla_flops_plain']:.4g}" if meta["xla_flops_plain"] else "n/a")
        + "; peak bf16 "
        + (f"{peak / 1e12:.0f} TFLOP/s a device" if peak else f"n/a ({meta['device_kind']})"),
        "",
        "| row | schedule | devices | step ms | best ms | MFU | compile s | host ops | "
        "issue ms | loss | status |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for rec in result["rows"]:
        mfu = rec.get("mfu")
        lines.append(
            "| "
            + " | ".join(
                [
                    rec["variant"],
                    rec["schedule"] or "-",
                    rec.get("mesh", "-"),
                    _ms(rec.get("step_seconds")),
                    _ms(rec.get("best_seconds")),
                    "n/a" if mfu is None else f"{mfu:.1%}",
                    "-" if rec.get("compile_seconds") is None else f"{rec['compile_seconds']:.1f}",
                    "-" if rec.get("host_ops") is None else str(rec["host_ops"]),
                    _ms(rec.get("issue_seconds")),
                    "-" if rec.get("loss") is None else f"{rec['loss']:.4f}",
                    rec.get("status", "?"),
                ]
            )
            + " |"
        )
    return "\n".join(lines)


def _difference(rec: dict, names) -> str:
    """The largest of `names` in the row's difference from ``"xla"`` (``ref, max`` on xla)."""
    if rec.get("abs_max"):
        return f"ref, max {max(rec['abs_max'][n] for n in names):.3g}"
    diff = rec.get("diff_vs_xla")
    return "-" if not diff else f"{max(diff[n] for n in names):.3g}"


def _not_a_gpu(meta: dict) -> str:
    lengths = ",".join(map(str, meta["lengths"] or []))
    gpu = ",".join(map(str, meta["gpu_lengths"]))
    return (
        f"; not a GPU: L={lengths}"
        + ("" if lengths == gpu else f" rather than a GPU's {gpu}")
        + ", and no cudnn (the kernel is an NVIDIA GPU's)"
    )


def attention_table(section: dict) -> str:
    """The attention rows' table as Markdown, with a few lines of context above it."""
    meta = section["meta"]
    lines = [
        f"attention: Llama-3-8B's, causal, batch {meta['batch']}, {meta['heads']} query heads "
        f"and {meta['kv_heads']} key/value heads of {meta['head_dim']}, {meta['dtype']}; "
        f"forward and backward (dq, dk, dv) by jpipe.models.attention.causal_attention; "
        f"median of {meta['reps']} after {meta['warmup']} warm-up",
        f"on {meta['device_kind'] or '?'} ({meta['platform'] or '?'}, jax {meta['jax'] or '?'})"
        + ("" if meta["platform"] in ("gpu", None) else _not_a_gpu(meta)),
        "TFLOP/s: FlashAttention-2's count (the causal half; xla computes the masked half too). "
        "diff: the largest |difference| from the xla row at the same L, in the output and in "
        "the worst of dq, dk, dv (the xla row gives the largest magnitude instead)",
        "",
        "| attention | L | platform | fwd+bwd ms | best ms | TFLOP/s | temp MiB | compile s | "
        "diff out | diff grads | status |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for rec in section["rows"]:
        name = rec["implementation"]
        if rec.get("block"):
            name += f" (tile {rec['block']})"
        temp = rec.get("temp_bytes")
        lines.append(
            "| "
            + " | ".join(
                [
                    name,
                    "?" if rec.get("seq_len") is None else str(rec["seq_len"]),
                    rec.get("platform") or "?",
                    _ms(rec.get("step_seconds")),
                    _ms(rec.get("best_seconds")),
                    "-" if rec.get("tflops") is None else f"{rec['tflops']:.3g}",
                    "-" if temp is None else f"{temp / 2**20:.1f}",
                    "-" if rec.get("compile_seconds") is None else f"{rec['compile_seconds']:.1f}",
                    _difference(rec, ATTENTION_RESULTS[:1]),
                    _difference(rec, ATTENTION_RESULTS[1:]),
                    rec.get("status", "?"),
                ]
            )
            + " |"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    args = settle(parser().parse_args(argv))
    if args.worker:
        return worker(args)
    result = orchestrate(args)
    print(table(result))
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=1) + "\n")
        print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
