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

from jpipe.runtime.devices import use_cpu_devices
from jpipe.schedule.actions import Schedule
from jpipe.schedule.registry import get_schedule
from jpipe.schedule.validate import analyze


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


# -- models with their own collectives -------------------------------------------


@dataclasses.dataclass(frozen=True)
class CheckModel:
    """A model for `check_schedule`: stage functions, their whole parameters, a batch.

    Attributes:
      stages: the stage functions ``stage(params, x, inputs) -> y`` as the
        pipeline runs them, each device on its block of a split array, with
        their own collectives over the mesh's model axes (``tensor``).
      params: one pytree per stage, the *whole* (unsplit) arrays.
      make_batch: ``make_batch(rows, seed) -> batch``.
      specs: one pytree per stage like its parameters, a `PartitionSpec`
        (or None) per array: how `Pipeline.pack` splits it (None: nothing
        split).
      reference: stage functions of the whole model, unsplit, without
        collectives: the reference. None: the reference is `stages` under
        `jax.shard_map` over the model axes, as a `shard_map` user runs them
        (``check_vma=True``), unpipelined on the whole batch.
      name: for reports.
      carries: for a sliced schedule, ``carries(rows) -> list``: per stage the
        shape structs of its slice carry for one slice of `rows` rows, or None
        for a stage without one (`jpipe.Pipeline`'s ``carries``). A carried
        stage is ``stage(params, x, inputs, carry) -> (y, carry)``; the
        reference then runs whole sequences.
    """

    stages: tuple
    params: list
    make_batch: object
    specs: list | None = None
    reference: tuple | None = None
    name: str = "model"
    carries: object = None


TENSOR_BLOCKS = ("mlp", "attention", "two_blocks", "sequence")
"""The blocks of `tensor_model`, each written with plain JAX collectives over
``tensor`` as `jax.shard_map` users write them:

- ``mlp``: Megatron's row-split MLP, ``x + psum(tanh(x @ w1) @ w2)``, `w1`
  split by columns and `w2` by rows;
- ``attention``: causal attention split by heads: q, k and v projections by
  columns, the output projection by rows, closed by ``psum``;
- ``two_blocks``: a mixture of experts split over ``tensor`` (each device
  its experts, closed by ``pmean``: the mean over every expert), then the
  row-split MLP closed by ``psum``;
- ``sequence``: the row-split MLP with sequence parallelism: the partial
  products summed and split over the sequence by ``psum_scatter``, a
  nonlinearity on each device's positions, then ``all_gather(...,
  to="invarying")`` back and the residual added.
"""


def tensor_model(num_stages: int, block: str = "mlp", seed: int = 0) -> CheckModel:
    """A small model whose every stage runs a `TENSOR_BLOCKS` block split over ``tensor``.

    Stage 0 embeds the tokens first, the last stage ends with a head and the
    mean cross-entropy; every stage runs one block. Sizes: vocabulary 16,
    width 8, 4 heads, 4 experts, MLP width 16, sequences of 4 tokens, so a
    ``tensor`` axis of 1, 2 or 4 divides every split. The reference is the
    same model unsplit (`CheckModel.reference`).
    """
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax import lax
    from jax.sharding import PartitionSpec as P

    if block not in TENSOR_BLOCKS:
        raise ValueError(f"unknown block {block!r}: use one of {', '.join(TENSOR_BLOCKS)}")
    if num_stages < 1:
        raise ValueError(f"num_stages must be at least 1, got {num_stages}")
    V, D, H, E, L, HEADS = 16, 8, 16, 4, 4, 4
    rng = np.random.default_rng(seed)

    def normal(*shape, scale=None):
        # Scaled by the fan-in, so activations and the loss stay near 1 over
        # many stages (the loss starts near log(16)).
        scale = 0.5 / math.sqrt(shape[-2]) if scale is None else scale
        return jnp.asarray(rng.normal(size=shape) * scale, jnp.float32)

    def mlp(p, x, axis):
        y = jnp.tanh(x @ p["w1"]) @ p["w2"]
        return x + (y if axis is None else lax.psum(y, axis))

    def attention(p, x, axis):
        b, n, _ = x.shape
        heads = p["wq"].shape[1] // (D // HEADS)

        def split(w):
            return (x @ w).reshape(b, n, heads, D // HEADS)

        q, k, v = split(p["wq"]), split(p["wk"]), split(p["wv"])
        out = jax.nn.dot_product_attention(q, k, v, is_causal=True).reshape(b, n, -1)
        y = out @ p["wo"]
        return x + (y if axis is None else lax.psum(y, axis))

    def experts(p, x, axis):
        # Each expert: tanh(x @ w_e) @ v_e; the block adds their mean.
        h = jnp.tanh(jnp.einsum("bnd,edf->ebnf", x, p["we"]))
        y = jnp.einsum("ebnf,efd->ebnd", h, p["ve"])
        y = y.mean(axis=0)
        return x + (y if axis is None else lax.pmean(y, axis))

    def sequence(p, x, axis):
        y = jnp.tanh(x @ p["w1"]) @ p["w2"]
        if axis is None:
            return x + jnp.tanh(y)
        local = jnp.tanh(lax.psum_scatter(y, axis, scatter_dimension=1, tiled=True))
        # to="invarying": the gathered value is the same on every device, and
        # JAX then knows it (a plain all_gather's result counts as varying).
        return x + lax.all_gather(local, axis, axis=1, tiled=True, to="invarying")

    mlp_params = lambda: {"w1": normal(D, H), "w2": normal(H, D)}  # noqa: E731
    mlp_specs = {"w1": P(None, "tensor"), "w2": P("tensor", None)}
    blocks = {
        "mlp": (
            lambda p, x, a: mlp(p["mlp"], x, a),
            lambda: {"mlp": mlp_params()},
            {"mlp": mlp_specs},
        ),
        "attention": (
            lambda p, x, a: attention(p["attn"], x, a),
            lambda: {"attn": {k: normal(D, D) for k in ("wq", "wk", "wv", "wo")}},
            {
                "attn": {
                    "wq": P(None, "tensor"),
                    "wk": P(None, "tensor"),
                    "wv": P(None, "tensor"),
                    "wo": P("tensor", None),
                }
            },
        ),
        "two_blocks": (
            lambda p, x, a: mlp(p["mlp"], experts(p["experts"], x, a), a),
            lambda: {
                "experts": {"we": normal(E, D, H), "ve": normal(E, H, D)},
                "mlp": mlp_params(),
            },
            {"experts": {"we": P("tensor"), "ve": P("tensor")}, "mlp": mlp_specs},
        ),
        "sequence": (
            lambda p, x, a: sequence(p["mlp"], x, a),
            lambda: {"mlp": mlp_params()},
            {"mlp": mlp_specs},
        ),
    }
    run_block, make_block, block_specs = blocks[block]

    def stage_fn(s, axis):
        def stage(params, x, inputs):
            if s == 0:
                x = params["embed"][inputs["tokens"]]
            x = run_block(params["block"], x, axis)
            if s < num_stages - 1:
                return x
            logits = x @ params["head"]
            logp = jax.nn.log_softmax(logits)
            return -jnp.take_along_axis(logp, inputs["targets"][..., None], axis=-1).mean()

        return stage

    params, specs = [], []
    for s in range(num_stages):
        p, sp = {"block": make_block()}, {"block": block_specs}
        if s == 0:
            p["embed"], sp["embed"] = normal(V, D, scale=1.0), None
        if s == num_stages - 1:
            p["head"], sp["head"] = normal(D, V), None
        params.append(p)
        specs.append(sp)

    def make_batch(rows: int, seed: int = 1) -> dict:
        r = np.random.default_rng(seed)
        return {
            "tokens": jnp.asarray(r.integers(0, V, (rows, L)), jnp.int32),
            "targets": jnp.asarray(r.integers(0, V, (rows, L)), jnp.int32),
        }

    return CheckModel(
        stages=tuple(stage_fn(s, "tensor") for s in range(num_stages)),
        params=params,
        make_batch=make_batch,
        specs=specs,
        reference=tuple(stage_fn(s, None) for s in range(num_stages)),
        name=f"tensor_model:{block}",
    )


def load_model(
    spec: CheckModel | str,
    num_stages: int,
    seed: int = 0,
    *,
    config=None,
    tensor: int = 1,
) -> CheckModel:
    """A `CheckModel` as `check_schedule`'s `model` names it.

    ``"path/to/file.py:function"`` takes either form of builder, so that the
    file ``train.py --config.model=`` names serves here too:

    - the trainer's, ``build(args: jpipe.models.BuildArgs) ->
      jpipe.models.StagedModel``: called with `config`'s ``config.model``
      fields and `num_stages` stages (split over ``tensor`` when `tensor` >
      1), its weights from ``init(seed)``, its batches from `config`'s
      ``config.data`` (the training batches ``train.py`` would read);
    - the checker's own, ``build(num_stages) -> CheckModel``.

    Which one a function is: its parameter's annotation says (``BuildArgs``
    or ``int``), or its name (``num_stages``: the checker's); otherwise it is
    called as the trainer's, and as the checker's if that raises a
    `TypeError` or `AttributeError`.

    Args:
      spec: a `CheckModel`, ``"tensor:BLOCK"`` or ``"path/to/file.py:function"``.
      num_stages: S.
      seed: the weights' seed.
      config: for the trainer's builder, its config: a ``train.py`` config
        (`ml_collections.ConfigDict`, a mapping or a `jpipe.train.TrainConfig`)
        or the path of a config file; None uses the file's own ``get_config()``
        when it has one (as the examples do).
      tensor: the size of the ``tensor`` axis the check runs on.
    """
    if isinstance(spec, CheckModel):
        return spec
    spec = str(spec)
    if spec.startswith("tensor:"):
        return tensor_model(num_stages, spec.removeprefix("tensor:"), seed)
    if ":" in spec and spec.split(":")[0].endswith(".py"):
        # The trainer's loader: the file is imported under its own name, so its
        # classes are those of the user's `import`.
        from jpipe.models.registry import load_function

        build = load_function(spec, "model file")
        built = _build(build, spec, num_stages, config, tensor, seed)
        if not isinstance(built, CheckModel):
            raise ValueError(
                f"{spec} returned a {type(built).__name__}; it must return a "
                "jpipe.models.StagedModel (build(args: BuildArgs), as train.py calls it) or a "
                "jpipe.testing.CheckModel (build(num_stages))"
            )
        return dataclasses.replace(built, name=spec) if built.name == "model" else built
    raise ValueError(
        f"unknown model {spec!r}: give path/to/file.py:function (build(BuildArgs) -> "
        "StagedModel as for train.py, or build(num_stages) -> jpipe.testing.CheckModel) or "
        f"tensor:BLOCK with BLOCK one of {', '.join(TENSOR_BLOCKS)}"
    )


def _contract(build) -> str:
    """``"trainer"``, ``"checker"`` or ``"either"``: which form `build` says it is."""
    import inspect

    try:
        first = next(iter(inspect.signature(build).parameters.values()), None)
    except (TypeError, ValueError):
        return "either"
    if first is None:
        return "either"
    annotation = first.annotation
    text = annotation if isinstance(annotation, str) else getattr(annotation, "__name__", "")
    if text.endswith("BuildArgs"):
        return "trainer"
    if annotation is int or text == "int" or first.name == "num_stages":
        return "checker"
    return "either"


def _build(build, spec: str, num_stages: int, config, tensor: int, seed: int):
    """Calls `build` in its own form (see `load_model`); a `StagedModel` becomes a `CheckModel`."""
    contract = _contract(build)
    if contract == "checker":
        return build(num_stages)
    train_config, where = _train_config(build, spec, config)
    from jpipe.models import BuildArgs, StagedModel

    if train_config is None and contract == "trainer":
        raise ValueError(
            f"the model builder {spec} takes BuildArgs, whose config.model and batches come "
            "from a train.py config: give one (--config FILE, or config= in jpipe.testing), or "
            "a get_config() in the file"
        )
    model_config = train_config.model if train_config is not None else _empty_config()
    layers = ""
    if train_config is not None and len(train_config.layers_per_stage.split(",")) == num_stages:
        layers = train_config.layers_per_stage
    args = BuildArgs(model_config, num_stages, layers, "tensor" if tensor > 1 else None)
    try:
        built = build(args)
    except (TypeError, AttributeError) as e:
        if contract == "trainer":
            raise
        try:
            return build(num_stages)
        except Exception:
            raise ValueError(
                f"the model builder {spec}, called as build(BuildArgs) with config.model from "
                f"{where}, raised {type(e).__name__}: {e}; give the config whose config.model "
                "has its fields (--config FILE), or write build(num_stages) -> CheckModel"
            ) from e
    if not isinstance(built, StagedModel):
        return built
    if train_config is None:
        raise ValueError(
            f"the model builder {spec} returned a StagedModel, whose batches come from a "
            "train.py config: give one (--config FILE, or config= in jpipe.testing), or a "
            "get_config() in the file"
        )
    return _check_model_of(built, spec, train_config, seed, tensor)


def _empty_config():
    import ml_collections

    return ml_collections.FrozenConfigDict({})


def _train_config(build, spec: str, config):
    """``(TrainConfig, where it came from)`` for a trainer's builder, or ``(None, why)``."""
    import sys

    from jpipe.train.config import ConfigError, TrainConfig, config_from_file

    where = "the file's get_config()"
    if config is None:
        get_config = getattr(sys.modules.get(build.__module__), "get_config", None)
        if get_config is None:
            return None, "nowhere (no --config, and the file has no get_config())"
        config = get_config()
    elif isinstance(config, str):
        where = config
        config = config_from_file(config)
    else:
        where = "the config given"
    if isinstance(config, TrainConfig):
        return config, where
    try:
        return TrainConfig.from_config(config), where
    except ConfigError as e:
        raise ValueError(f"the config for {spec} ({where}): {e}") from None


def _check_model_of(model, spec: str, config, seed: int, tensor: int) -> CheckModel:
    """A trainer's `StagedModel` as a `CheckModel`, its batches from ``config.data``."""
    from jpipe.train.prepare import make_data

    params = model.init(seed)
    specs = model.specs(params) if model.specs is not None and tensor > 1 else None

    def make_batch(rows: int, seed: int = 1):
        del seed  # the data source's batches are a function of config.seed and the step
        return make_data(config, rows)[0].batch_at(0)

    return CheckModel(
        stages=tuple(model.stages),
        params=params,
        make_batch=make_batch,
        specs=specs,
        reference=None if specs is not None else tuple(model.stages),
        name=spec,
    )


def shard_map_reference(model: CheckModel, mesh, batch):
    """`model.stages` unpipelined on the whole `batch`, under `jax.shard_map` over `mesh`.

    `mesh` holds the model axes only (``tensor``); the stage functions run as
    a `shard_map` user runs them (``check_vma=True``), each device on its
    block of the split arrays, the batch on every device. Returns ``(loss,
    grads)`` with the whole arrays.
    """
    import jax
    from jax.sharding import PartitionSpec as P

    from jpipe.lower.pipeline import reference_value_and_grad

    def spec_of(x):
        return x is None or isinstance(x, P)

    in_specs = [
        jax.tree.map(lambda _: P(), p)
        if model.specs is None or sp is None
        else jax.tree.map(lambda spec: P() if spec is None else spec, sp, is_leaf=spec_of)
        for p, sp in zip(model.params, model.specs or [None] * len(model.params))
    ]
    run = jax.shard_map(
        lambda params, batch: reference_value_and_grad(model.stages, params, batch),
        mesh=mesh,
        in_specs=(in_specs, P()),
        out_specs=(P(), in_specs),
    )
    return jax.jit(run)(model.params, batch)


# -- the check -----------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class CheckResult:
    """What `check_schedule` found.

    Attributes:
      passed: loss and every gradient within `rtol` of the reference, and
        the copies of a replicated stage's gradients equal to the bit.
      max_abs_err: the largest absolute difference over loss and gradients
        (and between a replicated stage's copies of its gradients).
      max_rel_err: the largest per-array relative difference: for each array,
        the largest absolute difference over the reference's largest magnitude.
      loss, reference_loss: the two losses.
      compile_seconds: time to compile the pipelined step.
      temp_bytes, argument_bytes: per-device figures from `memory_analysis()`
        (under the per-rank lowering, the largest piece's).
      ticks: the lock-step program's length.
      tick_layout: the layout of its ticks (``"unit"`` or ``"packed"``).
      rtol: the tolerance used.
      lowering: the lowering the pipeline ran under (``"spmd"`` or ``"mpmd"``),
        as the `jpipe.Pipeline` built for the check reports it.
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
    fsdp: int = 1
    tensor: int = 1
    model: str = "small_model"
    lowering: str = "spmd"

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
    fsdp: int = 1,
    tensor: int = 1,
    model: CheckModel | str | None = None,
    rows_per_microbatch: int = 2,
    rtol: float = 1e-5,
    seed: int = 0,
    tick_layout: str = "auto",
    control: str = "auto",
    scan_layers: bool = False,
    activations: str | Sequence[str] = "array",
    compute_dtype: str = "float32",
    lowering: str = "spmd",
    config=None,
    **options,
) -> CheckResult:
    """Runs a schedule on fake CPU devices and compares it with the unpipelined model.

    Args:
      spec: a `jpipe.Schedule`, a registered name, a ``.csv`` file or
        ``path/to/file.py:function``.
      num_ranks, num_microbatches, num_chunks: for a schedule built by name or
        function (a CSV or a Schedule carries its own).
      data: the size of a ``data`` mesh axis to split the batch over.
      fsdp, tensor: the sizes of the ``fsdp`` axis (splits the batch and
        every parameter) and the ``tensor`` axis (splits what the model's
        specs say; its stages' own collectives run over it).
      model: the model to run instead of the built-in one (`small_model`):
        a `CheckModel` (your own stage functions, whole parameters, specs
        and reference), ``"path/to/file.py:function"`` for a function of the
        number of stages that returns one, or the trainer's builder,
        ``build(BuildArgs) -> StagedModel``, the one ``train.py
        --config.model=`` names (`load_model`), or ``"tensor:BLOCK"`` for
        `tensor_model` with a `TENSOR_BLOCKS` block. `scan_layers`,
        `activations` and `compute_dtype` then do not apply.
      config: for the trainer's builder, the ``train.py`` config (or its
        file) whose ``config.model`` it is built from and whose
        ``config.data`` gives the batch; None: the file's own ``get_config()``.
      rows_per_microbatch: rows per microbatch per data (and fsdp) shard.
      rtol: the largest accepted per-array relative error (see `CheckResult`).
      seed: for the model's weights and the batch.
      tick_layout: ``"auto"``, ``"unit"`` or ``"packed"`` (see `jpipe.Pipeline`).
      control: ``"auto"``, ``"cond"`` or ``"switch"`` (see `jpipe.Pipeline`).
      lowering: ``"spmd"`` or ``"mpmd"`` (per rank; see `jpipe.Pipeline`).
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
        tolerance, three orders below that noise. A bigger model can fuse
        otherwise in the two programs, and XLA may keep a fused bfloat16
        intermediate in float32 (``--xla_allow_excess_precision``, on by
        default): the GPT's bfloat16 pipeline differs from the same policy
        unpipelined by about 1% by default, and by 1e-7 with that flag off
        (tests/test_gpt.py). The same holds for
        `activations` with bfloat16 or float16 leaves: a float32 value that
        differs in its last bit between two splits of the batch (a matmul's
        sums in another order) can round to the neighbouring bfloat16, and
        through the backward that moved a weight gradient by 3.4e-4 (a fuzz
        case: 1 rank, 3 stages, M = 4, data 2, tuple and dict leaves, against
        the whole batch; 1.4e-7 against the same microbatches, under either
        lowering). Those models are checked against the same microbatches too.
      **options: passed to the schedule function.

    Returns:
      A `CheckResult`; `passed` says whether it matched.
    """
    schedule = get_schedule(spec, num_ranks, num_microbatches, num_chunks, **options)
    info = analyze(schedule)
    R, S, M = schedule.num_ranks, info.num_stages, info.num_microbatches
    devices_needed = R * data * fsdp * tensor
    ensure_cpu_devices(devices_needed)

    import jax

    from jpipe.lower.interface import lowering_kind
    from jpipe.lower.pipeline import Pipeline, make_mesh

    model = _model_to_check(
        model,
        S,
        seed,
        scan_layers,
        activations,
        compute_dtype,
        config=config,
        tensor=tensor,
        slices=schedule.num_slices,
    )
    # Sliced, a microbatch is a slice: the batch's rows are its sequences'.
    M = schedule.num_sequences
    batch = model.make_batch(M * rows_per_microbatch * data * fsdp, seed + 1)
    devices = sorted(jax.devices("cpu"), key=lambda d: (d.process_index, d.id))
    if not lowering_kind(lowering).one_program:  # driven from each process's host
        _check_every_process_holds_a_rank(devices[:devices_needed], R)
    mesh = make_mesh(R, data, devices[:devices_needed], fsdp=fsdp, tensor=tensor)
    carries = model.carries(rows_per_microbatch) if model.carries is not None else None
    pipe = Pipeline(
        model.stages,
        schedule,
        mesh,
        tick_layout=tick_layout,
        control=control,
        lowering=lowering,
        carries=carries,
    )
    packed = pipe.pack(model.params, model.specs)
    placed = _place(batch, pipe.batch_sharding)
    loss, grads, temp, arguments = _pipelined_loss_and_grads(pipe, packed, placed)
    # Float32: the reference on the whole batch at once. Lower precision (in the compute
    # or in the activations' leaves): on the same microbatches.
    kinds = (activations,) if isinstance(activations, str) else tuple(activations)
    low = compute_dtype != "float32" or any(kind != "array" for kind in kinds)
    ref_loss, ref_grads = _reference_loss_and_grads(model, batch, devices[:tensor], M if low else 1)
    abs_err, rel_err = compare((loss, pipe.unpack(grads)), (ref_loss, ref_grads))
    copies_err = _copies_err(pipe, grads)
    return CheckResult(
        passed=bool(math.isfinite(rel_err) and rel_err <= rtol and copies_err == 0),
        max_abs_err=max(abs_err, copies_err),
        max_rel_err=rel_err,
        loss=float(loss),
        reference_loss=float(ref_loss),
        compile_seconds=float(pipe.compile_seconds),
        temp_bytes=int(temp),
        argument_bytes=int(arguments),
        ticks=pipe.tick_plan.num_ticks,
        tick_layout=pipe.tick_plan.layout,
        rtol=rtol,
        schedule=schedule.name or str(spec),
        ranks=R,
        stages=S,
        microbatches=M,
        data=data,
        fsdp=fsdp,
        tensor=tensor,
        model=model.name,
        lowering=pipe.lowering,
    )


def _copies_err(pipe, grads) -> float:
    """The largest difference between two copies of a replicated stage's gradients
    (0.0 where no stage is replicated, or every copy is the same to the bit).

    Packed gradients spanning processes are gathered (a collective: every
    process calls this alike); with one mesh per rank, copies in another
    process are not compared.
    """
    import numpy as np

    from jpipe.stage.pack import _to_host

    layout, worst = pipe.layout, 0.0
    for s, (first, *copies) in enumerate(layout.stage_ranks):
        for b in layout.stage_buckets(s) if copies else ():
            rows = _to_host(grads[b]) if isinstance(grads, dict) else None
            for r in copies:
                if rows is not None:
                    here, there = rows[first], rows[r]
                elif grads[first] is not None and grads[r] is not None:
                    here, there = np.asarray(grads[first][b]), np.asarray(grads[r][b])
                else:  # a copy in another process
                    continue
                worst = max(worst, float(np.max(np.abs(here - there), initial=0.0)))
    return worst


def _model_to_check(
    model,
    num_stages: int,
    seed: int,
    scan_layers,
    activations,
    compute_dtype,
    *,
    config,
    tensor,
    slices: int = 1,
) -> CheckModel:
    """The `CheckModel` `check_schedule` runs: the built-in `small_model` for None
    (`sliced_model` for a sliced schedule), else `model` as `load_model` reads it,
    which must have `num_stages` stages."""
    if model is None and slices > 1:
        return sliced_model(num_stages, slices, seed)
    if model is None:
        stages, params, make_batch = small_model(
            num_stages, seed, scan_layers, activations, compute_dtype
        )
        return CheckModel(stages, params, make_batch, reference=stages, name="small_model")
    model = load_model(model, num_stages, seed, config=config, tensor=tensor)
    if len(model.stages) != num_stages:
        raise ValueError(f"{model.name} has {len(model.stages)} stages, the schedule {num_stages}")
    return model


SLICED_WIDTH = 8
"""`sliced_model`'s features per token."""


def sliced_model(num_stages: int, slices: int, seed: int = 0, tokens_per_slice: int = 3):
    """The checker's model for a sliced schedule (Seq1F1B): a `CheckModel` whose stages
    carry causal attention's keys and values from one slice of a sequence to the next.

    Every stage is a single-head attention layer over its carry
    (`jpipe.models.attention.attention_over_carry`) and a residual tanh layer;
    stage 0 reads the batch's features ``x``, the last returns the slice's
    mean squared error against ``y``. A slice's place in its sequence is the
    batch's ``pos`` of its first token. The reference runs the same stages
    on whole sequences, each carry starting at zeros: chained over the
    slices the carried attention is the whole sequence's causal attention,
    so the two agree to float32 rounding.
    """
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jpipe.models.attention import attention_over_carry

    width, tokens = SLICED_WIDTH, slices * tokens_per_slice

    def stage(params, x, inputs, carry):
        h = inputs["x"] if x is None else x
        q, k, v = (jnp.einsum("btd,de->bte", h, params[n])[:, :, None] for n in "qkv")
        out, carry = attention_over_carry(q, k, v, carry, inputs["pos"][0, 0])
        h = h + jnp.tanh(out[:, :, 0] @ params["o"])
        h = h + jnp.tanh(h @ params["m"])
        if "out" in params:  # the last stage
            return jnp.mean((h @ params["out"] - inputs["y"]) ** 2), carry
        return h, carry

    def whole(params, x, inputs):
        zeros = jnp.zeros((inputs["x"].shape[0], tokens, 1, width))
        return stage(params, x, inputs, (zeros, zeros))[0]

    keys = iter(jax.random.split(jax.random.key(seed), 6 * num_stages))
    params = []
    for s in range(num_stages):
        names = "qkvom" + ("" if s < num_stages - 1 else "u")
        p = {n: jax.random.normal(next(keys), (width, width)) / np.sqrt(width) for n in names}
        if s == num_stages - 1:
            p["out"] = p.pop("u")
        params.append(p)

    def make_batch(rows: int, batch_seed: int) -> dict:
        kx, ky = jax.random.split(jax.random.key(batch_seed))
        pos = np.broadcast_to(np.arange(tokens, dtype=np.int32), (rows, tokens))
        return {
            "x": np.asarray(jax.random.normal(kx, (rows, tokens, width))),
            "y": np.asarray(jax.random.normal(ky, (rows, tokens, width))),
            "pos": np.array(pos),
        }

    def carries(rows: int) -> list:
        kv = jax.ShapeDtypeStruct((rows, tokens, 1, width), jnp.float32)
        return [(kv, kv)] * num_stages

    return CheckModel(
        stages=(stage,) * num_stages,
        params=params,
        make_batch=make_batch,
        reference=(whole,) * num_stages,
        name=f"sliced_model (attention over a carry, {tokens} tokens)",
        carries=carries,
    )


def _check_every_process_holds_a_rank(devices, num_ranks: int) -> None:
    """Refuses a per-rank check in which some process of the run holds none of `devices`.

    The per-rank lowering hands the loss to every process of the run from the process
    of the last rank, and a process that holds no rank is not set up for that (it fails
    inside the transfer); so the check asks for a mesh that reaches every process."""
    import jax

    count = jax.process_count()
    held = sorted({d.process_index for d in devices})
    if len(held) == count:
        return
    idle = sorted(set(range(count)) - set(held))
    raise ValueError(
        f"under the per-rank lowering (mpmd) every process must hold a pipeline rank, but "
        f"the check's {len(devices)} devices ({num_ranks} ranks) lie in process(es) {held} "
        f"of {count}, none in {idle}: launch fewer processes or fewer devices each "
        "(jpipe.launch -n N --cpu_devices K with N x K the devices the check needs), or "
        "check more ranks"
    )


def _place(batch, sharding):
    """`batch` (the same on every process) laid out as `sharding` says, shard by shard.

    Not `jax.device_put`: in a run of several processes with one device each, jax 0.10.2's
    `device_put` makes an array whose `addressable_shards` raises ("must have one shard
    each"), which the SPMD program accepts but the per-rank lowering, reading each rank's
    shards, does not (``jpipe.launch -n 2 --cpu_devices 1 -- -m jpipe.check 1f1b -r 2 -m 4
    --lowering mpmd``)."""
    import jax
    import numpy as np

    def place(a):
        a = np.asarray(a)
        return jax.make_array_from_callback(a.shape, sharding, lambda index: a[index])

    return jax.tree.map(place, batch)


def _pipelined_loss_and_grads(pipe, packed, placed):
    """Compiles and runs `pipe`'s step on the `packed` parameters and the `placed` batch:
    ``(loss, grads, temp_bytes, argument_bytes)``, the bytes per device from
    `memory_analysis()` (`Pipeline.compiled_memory`; under the per-rank lowering, the
    largest temp and the largest arguments of any one piece)."""
    compiled = pipe.compile(packed, placed)
    loss, grads = compiled(packed, placed)
    temp, arguments = pipe.compiled_memory(compiled)
    return loss, grads, temp, arguments


def _reference_loss_and_grads(model: CheckModel, batch, tensor_devices, split: int):
    """The unpipelined loss and gradients `check_schedule` compares with, on the first CPU
    device (full float32 matmuls): the model's reference on the batch in `split`
    microbatches (1: the whole batch at once, for float32; M for lower precision in the
    compute or in the activations' leaves, the same microbatches as the pipeline), or,
    without a reference, its stages under `jax.shard_map` over `tensor_devices`."""
    import jax
    import numpy as np

    from jpipe.lower.pipeline import reference_value_and_grad

    with jax.default_device(jax.local_devices(backend="cpu")[0]):  # full float32 matmuls
        if model.reference is not None:
            return reference_value_and_grad(model.reference, model.params, batch, split)
        model_mesh = jax.sharding.Mesh(np.array(tensor_devices), ("tensor",))
        return shard_map_reference(model, model_mesh, batch)


def check_model(
    model,
    batch,
    schedule: str | Schedule = "1f1b",
    num_microbatches: int = 4,
    num_ranks: int | None = None,
    num_chunks: int | None = None,
    *,
    data: int = 1,
    fsdp: int = 1,
    tensor: int = 1,
    seed: int = 0,
    rtol: float = 1e-5,
    tick_layout: str = "auto",
    control: str = "auto",
    config=None,
    **options,
) -> CheckResult:
    """Checks your own stages the way `check_schedule` checks a schedule.

    Runs `model` pipelined under `schedule` on fake CPU devices and compares
    its loss and every gradient with `jax.value_and_grad` of the same stages
    run one after the other on the whole batch (`jpipe.run_stages`).

    Args:
      model: a `jpipe.models.StagedModel` (from `split_flax_model`,
        `split_nnx_model`, a trainer's model builder or your own), whose
        weights come from ``model.init(seed)``, or a `CheckModel`, or
        ``"path/to/file.py:build"``, the builder ``train.py
        --config.model=`` names (built for the schedule's stages with
        `config`'s ``config.model``; see `load_model`).
      batch: one global batch, a dict of arrays whose leading axis is cut
        into `num_microbatches` x `data` x `fsdp` equal parts (for a
        `CheckModel` or a builder's file, None uses its ``make_batch``:
        for the trainer's builder, the first training batch of
        ``config.data``).
      schedule: a `jpipe.Schedule`, a registered name, a ``.csv`` file or
        ``path/to/file.py:function``.
      num_microbatches: M.
      num_ranks: R; default the model's number of stages over `num_chunks`.
      num_chunks: stages per rank, for the schedules that take it.
      data, fsdp, tensor: mesh axes besides ``pipe`` (see `check_schedule`);
        with `tensor`, the stages split their arrays as ``model.specs`` says
        and the reference is the stages under `jax.shard_map`.
      seed: the weights' seed.
      rtol: the largest accepted per-array relative error (see `CheckResult`).
      tick_layout, control: see `jpipe.Pipeline`.
      config: for a builder's file, the ``train.py`` config (a ConfigDict or
        the path of its file); None: the file's own ``get_config()``.
      **options: passed to the schedule function.

    An array whose gradient is zero in exact arithmetic (a key bias in
    attention, which the softmax cancels) has only rounding for a gradient,
    on both sides, and fails the relative measure: leave such parameters
    out of the model.

    Returns:
      A `CheckResult`; `passed` says whether it matched.

    Raises:
      ValueError: the batch does not split into the microbatches and shards,
        or the schedule's stages are not the model's.
    """
    import jax

    ways = num_microbatches * data * fsdp
    if isinstance(model, str):  # a builder's file: built for the schedule's stages
        if num_ranks is None:
            raise ValueError(f"give num_ranks to check the model builder {model}")
        built = get_schedule(schedule, num_ranks, num_microbatches, num_chunks, **options)
        S = analyze(built).num_stages
        model = load_model(model, S, seed, config=config, tensor=tensor)
    if isinstance(model, CheckModel):
        checked = model
        if batch is not None:
            checked = dataclasses.replace(model, make_batch=lambda rows, seed: batch)
    else:
        params = model.init(seed)
        specs = model.specs(params) if model.specs is not None and tensor > 1 else None
        checked = CheckModel(
            stages=tuple(model.stages),
            params=params,
            make_batch=lambda rows, seed: batch,
            specs=specs,
            reference=None if specs is not None else tuple(model.stages),
        )
    rows = 2
    if batch is not None:
        rows_total = jax.tree.leaves(batch)[0].shape[0]
        if rows_total % ways:
            raise ValueError(
                f"the batch has {rows_total} rows, which do not split into {num_microbatches} "
                f"microbatches x data {data} x fsdp {fsdp} = {ways} equal parts"
            )
        rows = rows_total // ways
    S = len(checked.stages)
    if num_ranks is None:
        num_ranks = S // (num_chunks or 1)
    return check_schedule(
        schedule,
        num_ranks,
        num_microbatches,
        num_chunks,
        data=data,
        fsdp=fsdp,
        tensor=tensor,
        model=checked,
        rows_per_microbatch=rows,
        rtol=rtol,
        seed=seed,
        tick_layout=tick_layout,
        control=control,
        **options,
    )
