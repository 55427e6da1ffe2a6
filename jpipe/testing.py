"""Checking a schedule against the unpipelined model, for a user's test suite.

`check_schedule` runs a schedule on CPU fake devices with a small built-in
model whose stages differ (an embedding first, plain blocks in the middle, a
head and a cross-entropy loss last), and compares the loss and every gradient
with `jax.value_and_grad` of the same model without a pipeline, on the whole
batch. Its stages can pass each other pytrees with bfloat16 and float16
leaves instead of one float32 array (`ACTIVATIONS`). It also reports the
compile time and the compiled step's per-device memory from
`memory_analysis()`.

Fake devices: JAX fixes the device count when its backend starts. If it has
not started yet, `check_schedule` asks for as many CPU devices as it needs;
if it has, and there are too few, it says how to set them up (in a pytest
``conftest.py``: ``jax.config.update("jax_num_cpu_devices", 8)`` before any
JAX work).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

from jpipe._devices import use_cpu_devices
from jpipe._registry import get_schedule
from jpipe._schedule import Schedule
from jpipe._validate import analyze


def ensure_cpu_devices(count: int) -> None:
    """Makes sure JAX has at least `count` devices, faking CPU ones if it can."""
    import jax

    if jax.distributed.is_initialized():
        # Several processes: each has the devices it was started with; the count is global.
        have = len(jax.devices("cpu"))
        if have < count:
            raise RuntimeError(
                f"this check needs {count} CPU devices but the {jax.process_count()} processes "
                f"have {have} together: start them with more (jpipe.launch --cpu_devices)"
            )
        return
    use_cpu_devices(count, required=True)


# -- the built-in model --------------------------------------------------------

VOCAB, WIDTH, SEQ = 32, 16, 4


def _embed_stage(params, x, inputs):
    import jax.numpy as jnp

    del x
    h = params["embed"][inputs["tokens"]] + params["pos"]
    return jnp.tanh(h @ params["w"])


def _block_stage(params, x, inputs):
    import jax.numpy as jnp

    del inputs
    h = jnp.tanh(x @ params["w1"] + params["b1"])
    return x + h @ params["w2"] * params["scale"]


def _head_stage(params, x, inputs):
    import jax
    import jax.numpy as jnp

    h = jnp.tanh(x @ params["w"] + params["b"])
    logits = (h @ params["head"]).astype(jnp.float32)  # the loss in float32 whatever the compute
    logp = jax.nn.log_softmax(logits, axis=-1)
    picked = jnp.take_along_axis(logp, inputs["targets"][..., None], axis=-1)
    return -jnp.mean(picked)


SCANNED_BLOCKS = 2  # blocks a stage runs in one lax.scan with scan_layers


def _scanned_blocks(params, x):
    """`SCANNED_BLOCKS` residual blocks in one `lax.scan`, weights stacked as xs."""
    import jax

    def body(h, block):
        return _block_stage(block, h, None), None

    return jax.lax.scan(body, x, params)[0]


def _scanned_embed_stage(params, x, inputs):
    return _scanned_blocks(params["blocks"], _embed_stage(params["embed"], x, inputs))


def _scanned_block_stage(params, x, inputs):
    del inputs
    return _scanned_blocks(params, x)


# What one stage may pass to the next (B rows, L = SEQ, D = WIDTH):
ACTIVATIONS = (
    "array",  # float32 [B, L, D]
    "dict",  # {"h": float32 [B, L, D], "g": bfloat16 [B, L, D]}, added up by the next stage
    "tuple",  # (bfloat16 [B, L, D], float32 [B, D], float16 [B] that the next stage ignores)
)


def _send(h, kind: str):
    """The activation `h` (float32 [B, L, D]) as `kind` (see `ACTIVATIONS`)."""
    import jax.numpy as jnp

    if kind == "dict":
        return {"h": h, "g": jnp.tanh(h).astype(jnp.bfloat16)}
    if kind == "tuple":
        return (h.astype(jnp.bfloat16), jnp.mean(h, axis=1), h[:, 0, 0].astype(jnp.float16))
    return h


def _receive(x, kind: str):
    """The inverse of `_send`, up to its casts: float32 [B, L, D] again."""
    import jax.numpy as jnp

    if kind == "dict":
        return x["h"] + 0.5 * x["g"].astype(jnp.float32)
    if kind == "tuple":
        low, mean, _ = x  # the float16 leaf's gradient is zero
        return low.astype(jnp.float32) + mean[:, None, :]
    return x


def _in_dtype(stage, dtype: str):
    """`stage` computing in `dtype`: its float32 parameters and input activation cast first.

    The mixed-precision policy: float32 master parameters (their gradients,
    through the cast, are float32 and add up in float32), `dtype` for the
    matmuls and the activations sent on, float32 for the loss.
    """
    if dtype == "float32":
        return stage

    def wrapped(params, x, inputs):
        import jax
        import jax.numpy as jnp

        def cast(a):
            return a.astype(dtype) if jnp.issubdtype(a.dtype, jnp.floating) else a

        return stage(jax.tree.map(cast, params), jax.tree.map(cast, x), inputs)

    wrapped.__name__ = f"{stage.__name__}_{dtype}"
    return wrapped


def _with_activations(stage, kind_in: str | None, kind_out: str | None):
    """`stage` receiving a `kind_in` activation and sending a `kind_out` one (None: none)."""
    if kind_in in (None, "array") and kind_out in (None, "array"):
        return stage

    def wrapped(params, x, inputs):
        y = stage(params, None if kind_in is None else _receive(x, kind_in), inputs)
        return y if kind_out is None else _send(y, kind_out)

    wrapped.__name__ = f"{stage.__name__}_{kind_in or ''}_{kind_out or ''}"
    return wrapped


def small_model(
    num_stages: int,
    seed: int = 0,
    scan_layers: bool = False,
    activations: str | Sequence[str] = "array",
    compute_dtype: str = "float32",
):
    """The checker's model: ``(stage_fns, params_list, make_batch)``.

    Stage 0 embeds tokens, the last stage applies a head and returns the mean
    cross-entropy, the ones between are residual tanh blocks. With one stage,
    that stage does all three. With `scan_layers`, each middle stage runs
    `SCANNED_BLOCKS` blocks in one `jax.lax.scan` (weights stacked on a
    leading axis), and so does the first stage after its embedding (so the
    scan is also tried in a stage without an input gradient).

    `activations` is what each stage passes to the next: one of `ACTIVATIONS`
    for every boundary, or a sequence of ``num_stages - 1`` of them, one per
    boundary. The pytree kinds carry lower-precision leaves, so the model's
    loss depends on their casts; the unpipelined reference (`jpipe.run_stages`
    on the same functions) makes the same casts, so a pipeline must still
    match it to float32 precision.

    `compute_dtype` (e.g. ``"bfloat16"``) is the mixed-precision policy:
    parameters stay float32 and each stage casts them, and its input, to it;
    the loss is float32.
    """
    import jax
    import jax.numpy as jnp

    if num_stages < 1:
        raise ValueError(f"the model needs at least one stage, got {num_stages}")
    one = isinstance(activations, str)
    kinds = (activations,) * (num_stages - 1) if one else tuple(activations)
    if (
        (one and activations not in ACTIVATIONS)
        or len(kinds) != num_stages - 1
        or any(k not in ACTIVATIONS for k in kinds)
    ):
        raise ValueError(
            f"activations must be one of {ACTIVATIONS} or {num_stages - 1} of them (one per "
            f"boundary between {num_stages} stages), got {activations!r}"
        )
    keys = iter(jax.random.split(jax.random.key(seed), 8 * num_stages + 8))

    def normal(shape, scale):
        return jax.random.normal(next(keys), shape, jnp.float32) * scale

    def embed():
        return {
            "embed": normal((VOCAB, WIDTH), 1.0),
            "pos": normal((SEQ, WIDTH), 0.5),
            "w": normal((WIDTH, WIDTH), WIDTH**-0.5),
        }

    def block():
        return {
            "w1": normal((WIDTH, 2 * WIDTH), WIDTH**-0.5),
            "b1": normal((2 * WIDTH,), 0.1),
            "w2": normal((2 * WIDTH, WIDTH), (2 * WIDTH) ** -0.5),
            "scale": jnp.ones((WIDTH,), jnp.float32),
        }

    def head():
        return {
            "w": normal((WIDTH, WIDTH), WIDTH**-0.5),
            "b": normal((WIDTH,), 0.1),
            "head": normal((WIDTH, VOCAB), WIDTH**-0.5),
        }

    def blocks():
        return jax.tree.map(lambda *a: jnp.stack(a), *(block() for _ in range(SCANNED_BLOCKS)))

    if num_stages == 1:

        def whole(params, x, inputs):
            h = _embed_stage(params["embed"], None, inputs)
            if scan_layers:
                h = _scanned_blocks(params["blocks"], h)
            return _head_stage(params["head"], h, inputs)

        params = {"embed": embed(), "head": head()}
        if scan_layers:
            params["blocks"] = blocks()
        stages, params = [whole], [params]
    elif scan_layers:
        stages = [_scanned_embed_stage] + [_scanned_block_stage] * (num_stages - 2)
        stages += [_head_stage]
        params = [{"embed": embed(), "blocks": blocks()}]
        params += [blocks() for _ in range(num_stages - 2)] + [head()]
    else:
        stages = [_embed_stage] + [_block_stage] * (num_stages - 2) + [_head_stage]
        params = [embed()] + [block() for _ in range(num_stages - 2)] + [head()]

    boundaries = [None, *kinds, None]
    stages = [
        _with_activations(_in_dtype(f, compute_dtype), *boundaries[s : s + 2])
        for s, f in enumerate(stages)
    ]

    def make_batch(rows: int, seed: int = 1):
        k1, k2 = jax.random.split(jax.random.key(seed))
        return {
            "tokens": jax.random.randint(k1, (rows, SEQ), 0, VOCAB, jnp.int32),
            "targets": jax.random.randint(k2, (rows, SEQ), 0, VOCAB, jnp.int32),
        }

    return stages, params, make_batch


# -- the check -----------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class CheckResult:
    """What `check_schedule` found.

    Attributes:
      passed: loss and every gradient within `rtol` of the reference.
      max_abs_err: the largest absolute difference over loss and gradients.
      max_rel_err: the largest per-array relative difference: for each array,
        the largest absolute difference over the reference's largest magnitude.
      loss, reference_loss: the two losses.
      compile_seconds: time to compile the pipelined step.
      temp_bytes, argument_bytes: per-device figures from `memory_analysis()`.
      ticks: the lock-step program's length.
      tick_layout: the layout of its ticks (``"unit"`` or ``"packed"``).
      rtol: the tolerance used.
    """

    passed: bool
    max_abs_err: float
    max_rel_err: float
    loss: float
    reference_loss: float
    compile_seconds: float
    temp_bytes: int
    argument_bytes: int
    ticks: int
    tick_layout: str
    rtol: float
    schedule: str
    ranks: int
    stages: int
    microbatches: int
    data: int

    def summary(self) -> dict:
        return dataclasses.asdict(self)


def compare(got, want) -> tuple[float, float]:
    """``(max_abs_err, max_rel_err)`` over matching pytrees (see `CheckResult`)."""
    import jax
    import numpy as np

    abs_err, rel_err = 0.0, 0.0
    got_leaves, want_leaves = jax.tree.leaves(got), jax.tree.leaves(want)
    if jax.tree.structure(got) != jax.tree.structure(want):
        raise AssertionError(
            f"structures differ: {jax.tree.structure(got)} vs {jax.tree.structure(want)}"
        )
    for g, w in zip(got_leaves, want_leaves):
        g = np.asarray(g, np.float64)
        w = np.asarray(w, np.float64)
        if g.shape != w.shape:
            raise AssertionError(f"shapes differ: {g.shape} vs {w.shape}")
        diff = float(np.max(np.abs(g - w))) if g.size else 0.0
        if not np.isfinite(g).all() or math.isnan(diff):
            diff = math.inf  # a NaN or infinity where the reference has none is a failure
        scale = float(np.max(np.abs(w))) if w.size else 0.0
        abs_err = max(abs_err, diff)
        rel_err = max(rel_err, diff / scale if scale > 0 else diff)
    return abs_err, rel_err


def check_schedule(
    spec: str | Schedule,
    num_ranks: int | None = None,
    num_microbatches: int | None = None,
    num_chunks: int | None = None,
    *,
    data: int = 1,
    rows_per_microbatch: int = 2,
    rtol: float = 1e-5,
    seed: int = 0,
    tick_layout: str = "auto",
    control: str = "auto",
    scan_layers: bool = False,
    activations: str | Sequence[str] = "array",
    compute_dtype: str = "float32",
    **options,
) -> CheckResult:
    """Runs a schedule on fake CPU devices and compares it with the unpipelined model.

    Args:
      spec: a `jpipe.Schedule`, a registered name, a ``.csv`` file or
        ``path/to/file.py:function``.
      num_ranks, num_microbatches, num_chunks: for a schedule built by name or
        function (a CSV or a Schedule carries its own).
      data: the size of a ``data`` mesh axis to split the batch over.
      rows_per_microbatch: rows per microbatch per data shard.
      rtol: the largest accepted per-array relative error (see `CheckResult`).
      seed: for the model's weights and the batch.
      tick_layout: ``"auto"``, ``"unit"`` or ``"packed"`` (see `jpipe.Pipeline`).
      control: ``"auto"``, ``"cond"`` or ``"switch"`` (see `jpipe.Pipeline`).
      scan_layers: run the model's blocks in `jax.lax.scan` (see `small_model`).
      activations: what each stage passes to the next: one of `ACTIVATIONS`,
        or one per boundary between stages (see `small_model`).
      compute_dtype: the model's mixed-precision policy (see `small_model`):
        ``"bfloat16"`` computes in bfloat16 from float32 parameters. The
        reference is then like with like: the same policy without a
        pipeline, on the same microbatches (the mean of their losses), since
        bfloat16 rounds differently on another split of the batch: the whole
        batch at once differs from it by 1.3 to 1.8% (and float32 compute by
        2.2%), while the pipeline matched it exactly on every built-in
        schedule tried on CPU (relative error 0). So `rtol` stays a float32
        tolerance, three orders below that noise.
      **options: passed to the schedule function.

    Returns:
      A `CheckResult`; `passed` says whether it matched.
    """
    schedule = get_schedule(spec, num_ranks, num_microbatches, num_chunks, **options)
    info = analyze(schedule)
    R, S, M = schedule.num_ranks, info.num_stages, info.num_microbatches
    ensure_cpu_devices(R * data)

    import jax

    from jpipe._pipeline import Pipeline, make_mesh, reference_value_and_grad

    stages, params, make_batch = small_model(S, seed, scan_layers, activations, compute_dtype)
    batch = make_batch(M * rows_per_microbatch * data, seed + 1)
    devices = sorted(jax.devices("cpu"), key=lambda d: (d.process_index, d.id))
    mesh = make_mesh(R, data, devices[: R * data])
    pipe = Pipeline(stages, schedule, mesh, tick_layout=tick_layout, control=control)
    packed = pipe.pack(params)
    placed = jax.device_put(batch, pipe.batch_sharding)
    compiled = pipe.compile(packed, placed)
    loss, grads = compiled(packed, placed)
    with jax.default_device(jax.local_devices(backend="cpu")[0]):  # full float32 matmuls
        # Float32: the whole batch at once. Lower precision: the same microbatches.
        split = 1 if compute_dtype == "float32" else M
        ref_loss, ref_grads = reference_value_and_grad(stages, params, batch, split)
    abs_err, rel_err = compare((loss, pipe.unpack(grads)), (ref_loss, ref_grads))
    memory = compiled.memory_analysis()
    return CheckResult(
        passed=bool(math.isfinite(rel_err) and rel_err <= rtol),
        max_abs_err=abs_err,
        max_rel_err=rel_err,
        loss=float(loss),
        reference_loss=float(ref_loss),
        compile_seconds=float(pipe.compile_seconds),
        temp_bytes=int(memory.temp_size_in_bytes),
        argument_bytes=int(memory.argument_size_in_bytes),
        ticks=pipe.plan.num_ticks,
        tick_layout=pipe.plan.layout,
        rtol=rtol,
        schedule=schedule.name or str(spec),
        ranks=R,
        stages=S,
        microbatches=M,
        data=data,
    )
