"""Residuals made from parameters and inputs alone are rebuilt, not stashed.

F keeps per microbatch only the residuals that are activations (made from x,
or by a matrix product of microbatch data); a bf16 copy of a float32 weight,
a slice of a stacked weight, an embedding lookup or a mask is made again by
the I and W pieces that read it (`jpipe/stage/pieces.py`). These tests measure the
residual bytes before (`rebuilt_avals` were all stashed) and after, and check
that the pipeline still gives the loss and gradients of the unpipelined model.
"""

import dataclasses
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jpipe
from jpipe import StageKernels, testing
from jpipe.models import gpt

RTOL = 1e-5  # float32, as in test_compiler.py
ROWS, WIDTH, HIDDEN, LAYERS, VOCAB = 4, 8, 16, 3, 16
bf16 = jnp.bfloat16


def _bytes(avals) -> int:
    return sum(math.prod(a.shape) * np.dtype(a.dtype).itemsize for a in avals)


def _kinds(avals) -> set:
    return {(tuple(a.shape), str(a.dtype)) for a in avals}


class _Bf16Block(nn.Module):
    """float32 parameters, bfloat16 compute: Flax casts each weight per call."""

    @nn.compact
    def __call__(self, x):
        h = nn.tanh(nn.Dense(HIDDEN, dtype=bf16)(x))
        return (x + nn.Dense(WIDTH, dtype=bf16)(h)).astype(jnp.float32)


_BLOCK = _Bf16Block()


def _bf16_stage(params, x, inputs):
    del inputs
    return _BLOCK.apply({"params": params}, x)


def _stacked_stage(params, x, inputs):
    """Indexes a stacked weight, as a stage that holds several layers may."""
    del inputs
    for i in range(LAYERS):
        x = x + jnp.tanh(x @ params["w"][i])
    return x


def _scanned_bf16_stage(params, x, inputs):
    """The layers in a scan, each casting its slice of the stacked weight."""
    del inputs

    def body(h, w):
        return h + jnp.tanh(h.astype(bf16) @ w.astype(bf16)).astype(jnp.float32), None

    return jax.lax.scan(body, x, params["w"])[0]


def _embed_stage(params, x, inputs):
    del x
    h = params["embed"][inputs["tokens"]]  # from inputs alone: rebuilt
    return _BLOCK.apply({"params": params["block"]}, h)


def _head_stage(params, x, inputs):
    logits = x @ params["head"]
    logp = jax.nn.log_softmax(logits, axis=-1)
    return -jnp.mean(jnp.take_along_axis(logp, inputs["targets"][..., None], axis=-1))


def _block_params(seed):
    return _BLOCK.init(jax.random.key(seed), jnp.zeros((ROWS, WIDTH)))["params"]


def _stacked_params(seed):
    w = jax.random.normal(jax.random.key(seed), (LAYERS, WIDTH, WIDTH)) * WIDTH**-0.5
    return {"w": w}


_ACT = jax.ShapeDtypeStruct((ROWS, WIDTH), jnp.float32)


@pytest.mark.slow
def test_a_bf16_dense_stage_stashes_no_weight_copy():
    params = _block_params(0)
    k = StageKernels.trace(_bf16_stage, params, _ACT, {})
    weights = {tuple(a.shape) for a in jax.tree.leaves(params)}
    # Before, F stashed what jax.vjp keeps: both kernels cast to bf16, the
    # input in bf16, tanh's output and 1 - tanh's output.
    before = _bytes(k.res_avals) + _bytes(k.rebuilt_avals)
    after = _bytes(k.res_avals)
    assert before == 2 * (WIDTH * HIDDEN * 2 + ROWS * WIDTH + 2 * ROWS * HIDDEN), before
    assert after == 2 * (ROWS * WIDTH + 2 * ROWS * HIDDEN), after
    assert after == k.res_layout.sizes["bfloat16"] * 2
    assert _kinds(k.rebuilt_avals) == {((WIDTH, HIDDEN), "bfloat16"), ((HIDDEN, WIDTH), "bfloat16")}
    assert not {tuple(a.shape) for a in k.res_avals} & weights, k.res_avals
    # The carry is what it was: the rebuilt copies are made where read.
    assert not {tuple(a.shape) for a in k.carry_avals} & weights, k.carry_avals


@pytest.mark.parametrize("stage", [_stacked_stage, _scanned_bf16_stage], ids=["index", "scan"])
def test_a_stage_keeps_no_slice_of_a_stacked_weight(stage):
    params = _stacked_params(0)
    k = StageKernels.trace(stage, params, _ACT, {})
    shapes = [tuple(a.shape) for a in k.res_avals]
    assert (WIDTH, WIDTH) not in shapes and (LAYERS, WIDTH, WIDTH) not in shapes, shapes
    rebuilt = [tuple(a.shape) for a in k.rebuilt_avals]
    if stage is _stacked_stage:
        assert rebuilt == [(WIDTH, WIDTH)] * LAYERS, rebuilt
    else:  # the scan's per-layer bf16 copies, stacked as its ys
        assert rebuilt == [(LAYERS, WIDTH, WIDTH)], rebuilt
    # Activations only (stacked over the layers by a scan).
    assert {s[-2:] for s in shapes} == {(ROWS, WIDTH)}, shapes


def _model():
    stages = [_embed_stage, _bf16_stage, _stacked_stage, _scanned_bf16_stage, _head_stage]
    embed = jax.random.normal(jax.random.key(9), (VOCAB, WIDTH))
    head = jax.random.normal(jax.random.key(8), (WIDTH, VOCAB)) * WIDTH**-0.5
    params = [
        {"embed": embed, "block": _block_params(1)},
        _block_params(2),
        _stacked_params(3),
        _stacked_params(4),
        {"head": head},
    ]
    return stages, params


@pytest.mark.slow
def test_the_first_stage_rebuilds_its_embedding_lookup():
    stages, params = _model()
    inputs = {"tokens": jax.ShapeDtypeStruct((ROWS,), jnp.int32)}
    k = StageKernels.trace(stages[0], params[0], None, inputs)
    # The gather's indices and the looked-up rows, cast for the Dense.
    assert {((ROWS, 1), "int32"), ((ROWS, WIDTH), "bfloat16")} <= _kinds(k.rebuilt_avals)
    # tanh's output follows a product of microbatch data: stashed, not rebuilt.
    assert ((ROWS, HIDDEN), "bfloat16") in _kinds(k.res_avals)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["1f1b", "zb_h1"])
def test_rebuilt_residuals_give_the_unpipelined_loss_and_gradients(name):
    stages, params = _model()
    M = 4
    rng = np.random.default_rng(0)
    batch = {
        "tokens": rng.integers(0, VOCAB, (M * ROWS,)).astype(np.int32),
        "targets": rng.integers(0, VOCAB, (M * ROWS,)).astype(np.int32),
    }
    schedule = jpipe.get_schedule(name, len(stages), M)
    pipe = jpipe.Pipeline(stages, schedule, jpipe.make_mesh(len(stages), 1))
    loss, grads = pipe.value_and_grad(pipe.pack(params), batch)
    # bf16 products round differently on a whole batch: compare with the
    # same microbatches, one backward each, as the pipeline runs them.
    ref = jpipe.reference_value_and_grad(stages, params, batch, M)
    abs_err, rel_err = testing.compare((loss, pipe.unpack(grads)), ref)
    assert rel_err <= RTOL, (abs_err, rel_err)


@pytest.mark.slow
def test_gpt_stages_stash_no_weight_copy_scanned_or_not():
    config = gpt.GPTConfig(
        vocab_size=32, seq_len=4, num_layers=4, num_heads=1, d_model=8, d_ff=16, dtype="bfloat16"
    )
    inputs = {k: jax.ShapeDtypeStruct((2, 4), jnp.int32) for k in ("tokens", "targets")}
    x = jax.ShapeDtypeStruct((2, 4, 8), bf16)
    kept = {}
    for scan_layers in (False, True):
        model = gpt.make_stages(dataclasses.replace(config, scan_layers=scan_layers), "2,2")
        params = jax.eval_shape(model.init, jax.random.key(0))[1]
        k = StageKernels.trace(model.stages[1], params, x, inputs)
        weights = {tuple(a.shape) for a in jax.tree.leaves(params)}
        weights |= {s[1:] for s in weights}  # a layer's slice of a stacked weight
        assert not {s for s, _ in _kinds(k.res_avals)} & weights, k.res_avals
        assert {"bfloat16"} <= {dt for _, dt in _kinds(k.rebuilt_avals)}
        kept[scan_layers] = _bytes(k.res_avals)
    # Unrolled, the stage stashed 160 bytes more (per-block masks and weight
    # copies); now both keep the same activations.
    assert kept[False] == kept[True], kept
