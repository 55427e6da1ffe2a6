"""Blockwise attention and per-block rematerialization: the same model, less memory.

Exactness is float32 (1e-5 relative, as everywhere): the blockwise softmax
sums in another order than the dense one, by about 1e-7; a wrong mask, a
missed tile or a wrong gradient of the online softmax moves the figures by
far more. Do not loosen the tolerances.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jpipe
from jpipe import models, testing
from jpipe.models import attention, gpt, llama

pytestmark = pytest.mark.slow  # every test compiles and runs pipelines

RTOL = 1e-5

LLAMA = models.LlamaConfig(
    vocab_size=32, seq_len=8, num_layers=4, num_heads=4, num_kv_heads=2, d_model=16, d_ff=32
)
GPT = gpt.GPTConfig(vocab_size=32, num_layers=4, d_model=16, num_heads=2, seq_len=8, d_ff=32)


def _qkv(length, heads, kv_heads, width=8, rows=2, dtype=jnp.float32):
    keys = jax.random.split(jax.random.key(0), 4)
    q = jax.random.normal(keys[0], (rows, length, heads, width), dtype)
    k = jax.random.normal(keys[1], (rows, length, kv_heads, width), dtype)
    v = jax.random.normal(keys[2], (rows, length, kv_heads, width), dtype)
    w = jax.random.normal(keys[3], (rows, length, heads, width), dtype)
    return q, k, v, w


@pytest.mark.parametrize("block", [1, 4, 5, 12, 64])  # 5 -> 4, 64 -> 12: the largest divisor
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 2), (4, 1)])
def test_blockwise_attention_equals_the_dense_one_with_its_gradients(block, heads, kv_heads):
    q, k, v, w = _qkv(12, heads, kv_heads)

    def loss(q, k, v, implementation):
        return (attention.causal_attention(q, k, v, implementation, block) * w).sum()

    dense = jax.jit(jax.value_and_grad(loss, (0, 1, 2)), static_argnums=3)
    got_loss, got = dense(q, k, v, "blockwise")
    want_loss, want = dense(q, k, v, "xla")
    np.testing.assert_allclose(got_loss, want_loss, rtol=RTOL)
    for g, r in zip(got, want):
        np.testing.assert_allclose(g, r, rtol=RTOL, atol=RTOL * float(jnp.abs(r).max()))


def test_blockwise_attention_keeps_no_scores_for_its_backward():
    # What the backward keeps is q, k, v, the output, one float32 number per
    # query and head and the queries' first tile (one int32): nothing of size L x L.
    length, heads = 64, 4
    q, k, v, _ = _qkv(length, heads, 2)
    _, residuals = jax.vjp(
        lambda q, k, v: attention.causal_attention(q, k, v, "blockwise", 8), q, k, v
    )
    kept = sum(x.size for x in jax.tree.leaves(residuals))
    assert kept == 2 * q.size + k.size + v.size + 2 * length * heads + 1  # lse: B x L x H
    _, dense = jax.vjp(lambda q, k, v: attention.causal_attention(q, k, v, "xla"), q, k, v)
    assert max(x.size for x in jax.tree.leaves(dense)) >= 2 * heads * length * length


def test_blockwise_attention_in_bfloat16_is_close_to_float32():
    q, k, v, _ = _qkv(32, 4, 2, dtype=jnp.bfloat16)
    got = attention.causal_attention(q, k, v, "blockwise", 8).astype(jnp.float32)
    f32 = [x.astype(jnp.float32) for x in (q, k, v)]
    want = attention.causal_attention(*f32, "xla")
    assert got.dtype == jnp.float32 and float(jnp.abs(got - want).max()) < 0.05


@pytest.mark.parametrize(
    "module,config,remat",
    [(llama, LLAMA, policy) for policy in attention.REMAT_POLICIES] + [(gpt, GPT, "full")],
    ids=[f"llama-{policy}" for policy in attention.REMAT_POLICIES] + ["gpt-full"],
)
def test_each_remat_policy_and_blockwise_attention_is_the_same_model(module, config, remat):
    plain = module.make_stages(config, (2, 2))
    params = plain.init(0)
    batch = models.example_batch(GPT, 4, seed=1)
    want = jax.jit(jax.value_and_grad(plain.loss))(params, batch)
    changed = config.__class__(
        **{**config.__dict__, "remat": remat, "attention": "blockwise", "attention_block": 4}
    )
    model = module.make_stages(changed, (2, 2))
    assert jax.tree.structure(model.init(0)) == jax.tree.structure(params)  # same weights
    got = jax.jit(jax.value_and_grad(model.loss))(params, batch)
    _, rel = testing.compare(got, want)
    assert rel <= RTOL, rel


def test_full_remat_keeps_only_the_block_inputs():
    # A stage of two blocks under "full" keeps what enters each block, not
    # the activations inside it.
    config = models.LlamaConfig(**{**LLAMA.__dict__, "seq_len": 16})
    batch = models.example_batch(models.GPTConfig(32, 16, 1, 1, 4, 4), 2, seed=1)

    def kept(remat):
        model = llama.make_stages(models.LlamaConfig(**{**config.__dict__, "remat": remat}), (2, 2))
        params = model.init(0)
        x = jax.eval_shape(lambda p: model.stages[0](p, None, batch), params[0])
        x = jnp.zeros(x.shape, x.dtype)
        _, residuals = jax.vjp(lambda p, x: model.stages[1](p, x, batch), params[1], x)
        return sum(a.size for a in jax.tree.leaves(residuals) if a.ndim >= 3)  # activations

    assert kept("full") < kept("attention") < kept("none")


@pytest.mark.parametrize("lowering", jpipe.LOWERINGS)
def test_pipelined_over_tensor_with_the_iw_split_equals_the_model(lowering):
    # ZB-H1 runs I and W apart, so the split of a rematerialized block's
    # backward, and of the blockwise attention's own backward, is exercised.
    config = models.LlamaConfig(
        **{**LLAMA.__dict__, "attention": "blockwise", "attention_block": 4, "remat": "dots"}
    )
    model = models.build_model("llama", models.BuildArgs(config, 2, tensor_axis="tensor"))
    params = model.init(0)
    schedule = jpipe.get_schedule("zb_h1", 2, 4)
    pipe = jpipe.Pipeline(model.stages, schedule, jpipe.make_mesh(2, tensor=2), lowering=lowering)
    batch = models.example_batch(GPT, 8, seed=3)
    packed = pipe.pack(params, model.specs(params))
    got = pipe.value_and_grad(packed, jax.device_put(batch, pipe.batch_sharding))
    whole = models.build_model("llama", models.BuildArgs(LLAMA, 2))
    want = jpipe.reference_value_and_grad(whole.stages, params, batch)
    _, rel = testing.compare((got[0], pipe.unpack(got[1])), want)
    assert rel <= RTOL, rel


def test_configs_refuse_unknown_choices_naming_them():
    with pytest.raises(ValueError, match=r"LlamaConfig.attention must be one of .*'flash'"):
        models.LlamaConfig(**{**LLAMA.__dict__, "attention": "flash"})
    with pytest.raises(ValueError, match=r"GPTConfig.remat must be one of"):
        gpt.GPTConfig(**{**GPT.__dict__, "remat": "some"})
    with pytest.raises(ValueError, match=r"attention_block must be a positive int"):
        gpt.GPTConfig(**{**GPT.__dict__, "attention_block": 0})
