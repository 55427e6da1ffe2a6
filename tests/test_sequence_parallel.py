"""Sequence parallelism over ``tensor`` (``sequence_parallel``), alone and with ``vocab_split``.

Between the split matmuls each tensor device holds its slice of the
sequence: an all-gather before the column-split matmuls, a reduce-scatter
after the row-split ones (`jpipe.models.sequence`). Exactness is float32
(1e-5 relative, as everywhere) against the unpipelined, unsplit model, with
the I/W split (``zb_h1``, ``zbv``), blockwise attention and a remat policy.
Do not loosen the tolerances.
"""

import math

import jax
import numpy as np
import pytest

import jpipe
from jpipe import models, testing
from jpipe.models import gpt, vocab

pytestmark = pytest.mark.slow  # each test compiles a pipeline of a split model

RTOL = 1e-5

LLAMA = models.LlamaConfig(
    vocab_size=32, seq_len=8, num_layers=4, num_heads=4, num_kv_heads=2, d_model=16, d_ff=32
)
GPT = gpt.GPTConfig(vocab_size=32, num_layers=4, d_model=16, num_heads=2, seq_len=8, d_ff=32)


def _with(config, **changes):
    return type(config)(**{**config.__dict__, **changes})


def _weighted(batch):
    keep = np.array([8, 5, 8, 3, 8, 1, 6, 8])[: len(batch["tokens"])]
    weights = (np.arange(batch["tokens"].shape[1])[None, :] < keep[:, None]).astype(np.float32)
    return {**batch, "weights": weights}


def pipelined_against_the_model(name, config, batch, schedule="zb_h1", lowering="spmd"):
    """The loss and every gradient of `config` pipelined over pipe 2 x tensor 2, against
    `jax.value_and_grad` of the plain model (no split, no remat, dense attention)."""
    built = jpipe.get_schedule(schedule, 2, 4)
    stages = built.num_stages
    model = models.build_model(name, models.BuildArgs(config, stages, tensor_axis="tensor"))
    params = model.init(0)
    pipe = jpipe.Pipeline(model.stages, built, jpipe.make_mesh(2, tensor=2), lowering=lowering)
    packed = pipe.pack(params, model.specs(params))
    got = pipe.value_and_grad(packed, jax.device_put(batch, pipe.batch_sharding))
    plain = _with(
        config,
        vocab_split=False,
        sequence_parallel=False,
        attention="xla",
        remat="none",
        remat_logits=False,
        logit_chunks=1,
    )
    whole = models.build_model(name, models.BuildArgs(plain, stages))
    # The plain model's head is dense [D, V]; the split one stores it [V, D].
    want = jpipe.reference_value_and_grad(whole.stages, vocab.head_as_kernel(params), batch)
    _, rel = testing.compare((got[0], vocab.head_as_kernel(pipe.unpack(got[1]))), want)
    assert rel <= RTOL, rel


@pytest.mark.parametrize("lowering", jpipe.LOWERINGS)
def test_llama_on_sequence_slices_with_the_iw_split_equals_the_model(lowering):
    config = _with(
        LLAMA, sequence_parallel=True, attention="blockwise", attention_block=4, remat="full"
    )
    batch = models.example_batch(GPT, 8, seed=3)
    pipelined_against_the_model("llama", config, batch, "zb_h1", lowering)


@pytest.mark.parametrize("lowering", jpipe.LOWERINGS)
def test_llama_on_sequence_slices_split_over_the_vocabulary_equals_the_model(lowering):
    # zbv: four stages on two ranks, so a stage both receives and sends slices.
    config = _with(
        LLAMA,
        sequence_parallel=True,
        vocab_split=True,
        attention="blockwise",
        attention_block=2,
        remat="dots",
        remat_logits=True,
    )
    batch = models.example_batch(GPT, 8, seed=4)
    pipelined_against_the_model("llama", config, batch, "zbv", lowering)


def test_llama_scanned_on_sequence_slices_with_dropout_and_token_weights():
    # The whole head on slices: each device's tokens, their sums added;
    # logit_chunks cut each device's slice.
    config = _with(LLAMA, sequence_parallel=True, scan_layers=True, dropout=0.25, logit_chunks=2)
    batch = _weighted(models.example_batch(GPT, 8, seed=5))
    batch["keys"] = np.asarray(models.row_keys(7, 3, 8))
    pipelined_against_the_model("llama", config, batch, "zb_h1")


def test_gpt_on_sequence_slices_equals_the_model():
    config = _with(
        GPT, sequence_parallel=True, attention="blockwise", attention_block=4, remat="full"
    )
    batch = models.example_batch(GPT, 8, seed=6)
    pipelined_against_the_model("gpt", config, batch, "zb_h1", "spmd")


def test_gpt_on_sequence_slices_split_over_the_vocabulary_with_dropout_equals_the_model():
    config = _with(GPT, sequence_parallel=True, vocab_split=True, dropout=0.25, remat="dots")
    batch = models.example_batch(GPT, 8, seed=7)
    batch["keys"] = np.asarray(models.row_keys(7, 4, 8))
    pipelined_against_the_model("gpt", config, batch, "zbv", "mpmd")


def test_the_blocks_keep_sequence_slices():
    # Under full remat a stage keeps each block's input, and the head (whole,
    # no remat_logits) its normed input and logits: on each tensor device a
    # slice of the sequence, half of it on two.
    batch = models.example_batch(GPT, 8, seed=3)

    def kept(config):
        model = models.build_model("llama", models.BuildArgs(config, 2, tensor_axis="tensor"))
        pipe = jpipe.Pipeline(
            model.stages, jpipe.get_schedule("1f1b", 2, 4), jpipe.make_mesh(2, tensor=2)
        )
        pipe.pack(model.init(0), model.specs(model.init(0)))
        last = pipe.stage_kernels(batch)[-1]
        floats = [a.shape for a in last.res_avals if a.dtype == np.float32 and len(a.shape) >= 3]
        length = config.seq_len // (2 if config.sequence_parallel else 1)
        assert {shape[1] for shape in floats} == {length}  # B x L x ...: slices
        return sum(math.prod(shape) for shape in floats)

    full = _with(LLAMA, remat="full")
    assert kept(_with(full, sequence_parallel=True)) * 2 == kept(full)


def test_a_sequence_the_axis_does_not_divide_is_refused():
    config = _with(LLAMA, seq_len=7, sequence_parallel=True)
    model = models.build_model("llama", models.BuildArgs(config, 2, tensor_axis="tensor"))
    params = model.init(0)
    pipe = jpipe.Pipeline(
        model.stages, jpipe.get_schedule("1f1b", 2, 4), jpipe.make_mesh(2, tensor=2)
    )
    pipe.pack(params, model.specs(params))
    with pytest.raises(ValueError, match=r"2-way tensor axis must divide the sequence length 7"):
        pipe.stage_kernels(models.example_batch(_with(GPT, seq_len=7), 8))


def test_without_a_tensor_axis_the_options_change_nothing():
    config = _with(LLAMA, sequence_parallel=True, vocab_split=True)
    batch = models.example_batch(GPT, 4, seed=1)
    plain = models.build_model("llama", models.BuildArgs(LLAMA, 2))
    model = models.build_model("llama", models.BuildArgs(config, 2))
    params = model.init(0)  # the head stored [V, D] (vocab_split), the same numbers
    assert model.specs is None
    np.testing.assert_array_equal(
        jax.jit(model.loss)(params, batch),
        jax.jit(plain.loss)(vocab.head_as_kernel(params), batch),
    )


def test_check_model_takes_both_options():
    # jpipe.testing's own check, whose reference runs the split stages under
    # jax.shard_map (check_vma=True), as a user's test would.
    config = _with(LLAMA, sequence_parallel=True, vocab_split=True)
    model = models.build_model("llama", models.BuildArgs(config, 2, tensor_axis="tensor"))
    batch = models.example_batch(GPT, 8, seed=8)
    result = testing.check_model(model, batch, "1f1b", num_microbatches=4, tensor=2)
    assert result.passed, result
