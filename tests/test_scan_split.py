"""Scanned layers split into I and W as exactly and as evenly as unrolled ones.

A stage whose layers run in `jax.lax.scan` (or `nn.scan`, or a scan of a
rematerialised layer) has its whole backward in one scan equation. The I/W
split divides that scan's body by the same rule as the stage's equations
(`jpipe/stage/pieces.py`), so the I piece carries per-layer cotangents to W, not
a finished weight gradient. These tests compare scanned stages with the same
layers unrolled: the carry, the matmul FLOPs of each piece (from the jaxprs,
a scan's body counted once per iteration: XLA's ``cost_analysis()`` counts a
while loop's body once, whatever its trip count), the simulated bubble with
those costs, and the loss and gradients through a pipeline.
"""

import dataclasses
import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jpipe
from jpipe import Pipeline, StageKernels, make_mesh, testing
from jpipe.models import gpt, merge_stage_params, split_stage_params

RTOL = 1e-5  # float32, as in test_compiler.py

f32 = jnp.float32


def _dot_flops(jaxpr) -> int:
    """Matmul FLOPs of a jaxpr, inside calls too; a scan's body once per iteration."""
    total = 0
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "dot_general":
            (contract, _), _ = eqn.params["dimension_numbers"]
            lhs = eqn.invars[0].aval.shape
            out = eqn.outvars[0].aval.shape
            total += 2 * int(np.prod(out)) * int(np.prod([lhs[d] for d in contract]))
        times = eqn.params["length"] if eqn.primitive.name == "scan" else 1
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            total += times * _dot_flops(sub)
    return total


def _costs(k: StageKernels, params, inputs) -> dict:
    """The carry size and the matmul FLOPs of the F, I and W pieces of one stage,
    and of its backward unsplit (B)."""
    g = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in jax.tree.leaves(k.y)]
    carry = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in k.carry_avals]

    def unsplit_backward(params, x, inputs, g):
        if k.has_x:
            return jax.vjp(lambda p, x_: k.fn(p, x_, inputs), params, x)[1](g)
        return jax.vjp(lambda p: k.fn(p, None, inputs), params)[1](g)

    y = jax.tree.unflatten(k.y_tree, g)
    both = jax.make_jaxpr(unsplit_backward)(params, k.x, inputs, y).jaxpr
    forward = _dot_flops(jax.make_jaxpr(k.forward)(params, k.x, inputs).jaxpr)
    return {
        "carry": sum(int(np.prod(a.shape)) for a in k.carry_avals),
        "B": _dot_flops(both) - forward,
        "F": forward,
        "I": _dot_flops(jax.make_jaxpr(k.input_grad)(params, inputs, k.res_avals, g).jaxpr),
        "W": _dot_flops(jax.make_jaxpr(k.weight_grad)(params, inputs, k.res_avals, carry).jaxpr),
    }


# -- one stage of dense layers, four ways ----------------------------------------

LAYERS, ROWS, WIDTH, HIDDEN = 3, 4, 16, 32


def _layer(w, h):
    return h + jnp.tanh(h @ w["w1"] + w["b1"]) @ w["w2"]


class _Dense(nn.Module):
    @nn.compact
    def __call__(self, h):
        return h + nn.Dense(WIDTH)(jnp.tanh(nn.Dense(HIDDEN)(h)))


class _DenseLayer(nn.Module):
    @nn.compact
    def __call__(self, h, _):
        return _Dense(name="block")(h), None


_NN_SCAN = nn.scan(
    _DenseLayer, variable_axes={"params": 0}, split_rngs={"params": True}, length=LAYERS
)()
_REMAT_SCAN = nn.remat_scan(_Dense, lengths=(LAYERS,))()  # one level: a scan of remat


def _stage(kind: str, scanned: bool, first: bool):
    """A stage of `LAYERS` dense layers; scanned ones take their weights stacked."""

    def fn(params, x, inputs):
        if first:  # no input gradient: I runs the cotangent chain alone
            x = inputs["x"]
        if kind == "nn.scan" and scanned:
            return _NN_SCAN.apply({"params": {"block": params}}, x, None)[0]
        if kind == "nn.remat_scan" and scanned:
            return _REMAT_SCAN.apply({"params": params}, x)
        if kind.startswith("nn."):
            # Against plain layers for remat_scan too: as traced here, its
            # backward runs no recomputation (the same matmuls as plain layers).
            for p in params:
                x = _Dense().apply({"params": p}, x)
            return x
        layer = jax.checkpoint(_layer) if kind == "remat" else _layer
        if scanned:
            return jax.lax.scan(lambda h, w: (layer(w, h), None), x, params)[0]
        for p in params:
            x = layer(p, x)
        return x

    return fn


def _layer_params(kind: str):
    if kind.startswith("nn."):
        x = jnp.zeros((ROWS, WIDTH), f32)
        return [_Dense().init(jax.random.key(i), x)["params"] for i in range(LAYERS)]
    rng = np.random.default_rng(0)
    return [
        {
            "w1": rng.normal(size=(WIDTH, HIDDEN)).astype(np.float32) / 4,
            "b1": rng.normal(size=(HIDDEN,)).astype(np.float32) / 4,
            "w2": rng.normal(size=(HIDDEN, WIDTH)).astype(np.float32) / 6,
        }
        for _ in range(LAYERS)
    ]


def _stack(layers):
    return jax.tree.map(lambda *a: jnp.stack(a), *layers)


@pytest.mark.parametrize("first", [False, True], ids=["middle", "first"])
@pytest.mark.parametrize("kind", ["lax.scan", "remat", "nn.scan", "nn.remat_scan"])
def test_a_scanned_stage_splits_like_the_unrolled_one(kind, first):
    layers = _layer_params(kind)
    act = jax.ShapeDtypeStruct((ROWS, WIDTH), f32)
    inputs = {"x": act}
    x = None if first else act
    scanned, unrolled = _stack(layers), layers
    k_scan = StageKernels.trace(_stage(kind, True, first), scanned, x, inputs)
    k_unrolled = StageKernels.trace(_stage(kind, False, first), unrolled, x, inputs)
    got = _costs(k_scan, scanned, inputs)
    want = _costs(k_unrolled, unrolled, inputs)
    # I hands W per-layer cotangents (stacked over the layers), never a
    # weight gradient: about what the unrolled stage carries.
    assert abs(got["carry"] - want["carry"]) <= 0.1 * want["carry"], (got, want)
    weights = {tuple(a.shape) for a in jax.tree.leaves(scanned)}
    assert not {tuple(a.shape) for a in k_scan.carry_avals} & weights, k_scan.carry_avals
    # Nothing computed twice: I and W do the work of the backward unsplit.
    assert got["I"] + got["W"] == got["B"], got
    assert got["W"] > 0 and got["I"] > 0
    # The same matmuls in each piece as unrolled, so zero-bubble schedules see
    # the same costs. One exception, in the scan itself: with no input
    # gradient, the unrolled backward drops the chain product into the first
    # layer's input, while a scan's backward runs every iteration alike (as
    # JAX's own transpose of the scan does, split or not).
    assert (got["F"], got["W"]) == (want["F"], want["W"])
    if first:
        assert got["I"] - want["I"] == got["B"] - want["B"] > 0, (got, want)
    else:
        assert got["I"] == want["I"], (got, want)


# -- the GPT ----------------------------------------------------------------------

_GPT = gpt.GPTConfig(vocab_size=32, seq_len=4, num_layers=4, num_heads=1, d_model=8, d_ff=16)


@functools.cache
def _gpt(scan_layers: bool):
    """The model cut ``2,2`` and its initial weights (initialised once: it compiles)."""
    model = gpt.make_stages(dataclasses.replace(_GPT, scan_layers=scan_layers), "2,2")
    return model, model.init(0)


@pytest.mark.slow
def test_scanned_gpt_has_the_unrolled_weights():
    unrolled, unrolled_params = _gpt(False)
    scanned, params = _gpt(True)
    assert scanned.scan_layers and not unrolled.scan_layers
    assert {tuple(a.shape) for a in jax.tree.leaves(params[1]["blocks"])} >= {(2, 8, 24)}
    same = jax.tree.map(
        np.array_equal, merge_stage_params(params), merge_stage_params(unrolled_params)
    )
    assert all(jax.tree.leaves(same))
    # Weight decay is decided per block: a stacked LayerNorm scale does not decay.
    mask = gpt.weight_decay_mask(params[1])
    assert not mask["blocks"]["ln_mlp"]["scale"] and mask["blocks"]["mlp_in"]["kernel"]
    with pytest.raises(ValueError, match="scan_layers must be True or False"):
        dataclasses.replace(_GPT, scan_layers="yes")


@pytest.mark.slow
def test_scanned_gpt_splits_like_the_unrolled_one():
    # One sequence a microbatch: activations smaller than weights, as at scale.
    batch = gpt.example_batch(_GPT, 1)
    inputs = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), batch)
    costs = {}
    for scan in (False, True):
        model, params_list = _gpt(scan)
        x, stages = None, []
        for fn, params in zip(model.stages, params_list):
            k = StageKernels.trace(fn, params, x, inputs)
            stages.append(_costs(k, params, inputs))
            x = k.y
        costs[scan] = stages
    unrolled, scanned = costs[False], costs[True]
    carry_u = sum(s["carry"] for s in unrolled)
    carry_s = sum(s["carry"] for s in scanned)
    assert abs(carry_s - carry_u) <= 0.1 * carry_u, (carry_s, carry_u)
    for piece in "FIWB":
        assert [s[piece] for s in scanned] == [s[piece] for s in unrolled], piece
    # With those costs per stage, ZB-H1 has the same simulated bubble.
    schedule = jpipe.get_schedule("zb_h1", 2, 4)
    bubbles = [
        jpipe.simulate(
            schedule, jpipe.Costs(**{p: tuple(float(s[p]) for s in stages) for p in "FIW"})
        ).bubble_fraction
        for stages in (unrolled, scanned)
    ]
    assert bubbles[0] == bubbles[1] and 0 < bubbles[0] < 1, bubbles


@pytest.mark.slow
@pytest.mark.parametrize("lowering", jpipe.LOWERINGS)
@pytest.mark.parametrize("name,ranks", [("1f1b", 2), ("zb_h1", 4)])
def test_scanned_gpt_is_exact(name, ranks, lowering):
    model, params = _gpt(True)
    if ranks != 2:  # the same weights cut into one block per stage
        model = gpt.make_stages(dataclasses.replace(_GPT, scan_layers=True), [1] * 4)
        params = split_stage_params(merge_stage_params(params), [1] * 4, scan_layers=True)
    batch = gpt.example_batch(_GPT, 8)
    schedule = jpipe.get_schedule(name, ranks, 4)
    pipe = Pipeline(model.stages, schedule, make_mesh(ranks, 1), lowering=lowering)
    loss, grads = pipe.value_and_grad(pipe.pack(params), batch)
    with jax.default_device(jax.devices("cpu")[0]):
        reference = jpipe.reference_value_and_grad(model.stages, params, batch)
    abs_err, rel_err = testing.compare((loss, pipe.unpack(grads)), reference)
    assert rel_err <= RTOL, (abs_err, rel_err)
