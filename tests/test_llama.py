"""The Llama-style decoder: exact against itself unpipelined, split over tensor, and its parts.

Tolerances are float32 ones (`jpipe.testing.check_model`'s 1e-5); do not
loosen them: a wrong split (a head group on the wrong device, a rotation at
the wrong position) moves the gradients by far more.
"""

import pathlib

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jpipe import models, testing
from jpipe import train as trainer
from jpipe.models import llama
from jpipe.train.config import TrainConfig, config_from_file

REPO = pathlib.Path(__file__).resolve().parents[1]

# 4 query heads sharing 2 key/value heads: grouped-query attention.
CONFIG = models.LlamaConfig(
    vocab_size=32, seq_len=8, num_layers=4, num_heads=4, num_kv_heads=2, d_model=16, d_ff=32
)


def batch(rows: int, seed: int = 0) -> dict:
    return models.example_batch(models.GPTConfig(32, 8, 1, 1, 4, 4), rows, seed)


@pytest.mark.slow
def test_pipelined_equals_the_model():
    model = models.build_model("llama", models.BuildArgs(CONFIG, num_stages=4))
    result = testing.check_model(model, batch(16), "1f1b", num_microbatches=4, data=2)
    assert result.passed, result.summary()


@pytest.mark.slow
def test_split_over_tensor_equals_the_model():
    # Each of the two devices holds 2 query heads and their key/value head.
    model = models.build_model("llama", models.BuildArgs(CONFIG, 2, tensor_axis="tensor"))
    specs = model.specs(model.init(0))
    assert specs[0]["blocks"][0]["k"]["kernel"] == jax.sharding.PartitionSpec(None, "tensor")
    assert specs[1]["blocks"][0]["down"]["kernel"] == jax.sharding.PartitionSpec("tensor", None)
    result = testing.check_model(model, batch(8), "zb_h1", num_microbatches=4, tensor=2, data=2)
    assert result.passed, result.summary()


@pytest.mark.slow
def test_every_split_starts_from_the_same_weights_and_loss():
    b = batch(3)
    split = llama.make_stages(CONFIG, "1,2,1")
    whole = llama.make_stages(CONFIG, (4,))
    params, whole_params = split.init(0), whole.init(0)
    chex.assert_trees_all_equal(
        models.merge_stage_params(params), models.merge_stage_params(whole_params)
    )
    chex.assert_trees_all_close(split.loss(params, b), whole.loss(whole_params, b), rtol=1e-6)


@pytest.mark.slow
def test_rotary_scores_depend_only_on_the_distance():
    q = jax.random.normal(jax.random.key(0), (1, 1, 1, 8))
    k = jax.random.normal(jax.random.key(1), (1, 1, 1, 8))
    L = 6
    rq = llama.rotary(jnp.broadcast_to(q, (1, L, 1, 8)), 10000.0)[0, :, 0]
    rk = llama.rotary(jnp.broadcast_to(k, (1, L, 1, 8)), 10000.0)[0, :, 0]
    scores = rq @ rk.T  # scores[t, s]: the query at t against the key at s
    for offset in range(-L + 1, L):
        np.testing.assert_allclose(np.diag(scores, offset), np.diag(scores, offset)[0], rtol=1e-5)
    np.testing.assert_allclose(scores[0, 0], q.ravel() @ k.ravel(), rtol=1e-6)  # position 0


@pytest.mark.slow
def test_attention_is_causal():
    model = llama.make_stages(CONFIG, (2, 2))
    params = model.init(0)
    b = batch(2)
    tokens = b["tokens"].copy()
    tokens[:, 5] = (tokens[:, 5] + 1) % 32
    changed = {**b, "tokens": tokens}
    x, y = (model.stages[0](params[0], None, inputs) for inputs in (b, changed))
    np.testing.assert_array_equal(x[:, :5], y[:, :5])
    assert not np.allclose(x[:, 5:], y[:, 5:])


def test_config_refuses_what_cannot_work():
    with pytest.raises(ValueError, match="num_kv_heads=3 must divide num_heads=4"):
        models.LlamaConfig(32, 8, 2, num_heads=4, num_kv_heads=3, d_model=16, d_ff=32)
    with pytest.raises(ValueError, match="must be even"):
        models.LlamaConfig(32, 8, 2, num_heads=16, num_kv_heads=4, d_model=16, d_ff=32)


def test_the_8gpu_config_has_the_parameters_it_says():
    config = TrainConfig.from_config(config_from_file(REPO / "configs" / "llama_8gpu.py"))
    assert config.model_name == "llama" and config.mesh.size == 8
    shapes = jax.eval_shape(llama.make_stages(config.model, (16,)).init, jax.random.key(0))
    assert models.num_params(shapes) == 1_107_363_840  # the docstring's count
    assert config.model.num_kv_heads % config.mesh.tensor == 0


def test_the_trainer_builds_it_by_name_and_checks_the_tensor_axis():
    config = config_from_file(REPO / "configs" / "default.py")
    config.model = {
        "name": "llama",
        **{k: getattr(CONFIG, k) for k in ("vocab_size", "seq_len", "num_layers", "num_heads")},
        **{k: getattr(CONFIG, k) for k in ("num_kv_heads", "d_model", "d_ff")},
    }
    config.model.vocab_size = 256  # the byte corpus
    config.mesh.pipe, config.mesh.data, config.mesh.tensor = 2, 2, 2
    prepared = trainer.prepare(config)
    assert isinstance(prepared.config.model, models.LlamaConfig)
    assert prepared.model.layers_per_stage == (2, 2) and prepared.model.specs is not None
    config.model.num_kv_heads = 1
    with pytest.raises(trainer.ConfigError, match="must divide model.num_kv_heads=1"):
        trainer.prepare(config)


def test_the_default_config_trains_a_llama_by_name():
    from jpipe.train.config import expand_shorthands

    argv = expand_shorthands(["train.py", "--config.model=llama", "--config.data=f.py:g"])
    assert argv[1:] == ["--config.model.name=llama", "--config.data.source=f.py:g"]
    config = config_from_file(REPO / "configs" / "default.py")
    config.model.name = "llama"  # the GPT's sizes; one key/value head per query head
    prepared = trainer.prepare(config)
    assert prepared.config.model.num_kv_heads == prepared.config.model.num_heads == 4


@pytest.mark.slow
def test_dropout_is_drawn_from_the_row_keys_pipelined_exactly():
    config = models.LlamaConfig(**{**CONFIG.__dict__, "dropout": 0.2})
    model = models.build_model("llama", models.BuildArgs(config, num_stages=2))
    assert model.keys == "keys"
    b = {**batch(8), "keys": np.asarray(models.row_keys(0, 0, 8))}
    params = model.init(0)
    assert float(model.loss(params, b)) != float(model.loss(params, batch(8)))
    result = testing.check_model(model, b, "1f1b", num_microbatches=4)
    assert result.passed, result.summary()


@pytest.mark.slow
def test_scanned_blocks_split_over_tensor_equal_the_model():
    config = models.LlamaConfig(**{**CONFIG.__dict__, "scan_layers": True})
    model = models.build_model("llama", models.BuildArgs(config, 2, tensor_axis="tensor"))
    stacked = model.specs(model.init(0))[0]["blocks"]["q"]["kernel"]
    assert stacked == jax.sharding.PartitionSpec(None, None, "tensor")  # blocks, D, heads
    result = testing.check_model(model, batch(8), "1f1b", num_microbatches=4, tensor=2)
    assert result.passed, result.summary()


@pytest.mark.slow
def test_logit_chunks_give_the_plain_heads_loss_and_gradients():
    # The head in slices (each recomputed in the backward), pipelined with its
    # backward split into I and W, against the plain head without a pipeline.
    import dataclasses

    import jpipe

    plain = llama.make_stages(CONFIG, "2,2")
    sliced = llama.make_stages(dataclasses.replace(CONFIG, logit_chunks=4), "2,2")
    params = plain.init(jax.random.key(0))
    chex.assert_trees_all_equal(params, sliced.init(jax.random.key(0)))
    data = batch(8)
    with jax.default_device(jax.devices("cpu")[0]):
        want = jpipe.reference_value_and_grad(plain.stages, params, data)
    pipe = jpipe.Pipeline(sliced.stages, jpipe.get_schedule("zb_h1", 2, 4), jpipe.make_mesh(2, 1))
    loss, grads = pipe.value_and_grad(pipe.pack(params), data)
    _, rel = testing.compare((loss, pipe.unpack(grads)), want)
    assert rel <= 1e-5
