"""Dropout in stages: exact against the unpipelined model fed the same keys.

Randomness comes with the batch: ``batch["keys"]`` holds one key per row
(`jpipe.models.row_keys`), a pure function of the seed, the step and the row's
index in the global batch, and each GPT module folds its own layer (and site)
number into it. The pipeline cuts the keys into microbatches and data shards
like the tokens, so every row draws the same masks however the batch is split:
the pipelined loss and gradients equal `jax.value_and_grad` of the whole
batch, unpipelined, in float32. (The trainer's resume test with dropout is in
tests/test_train.py.)
"""

import flax.linen as nn
import jax
import numpy as np
import pytest

import jpipe
from jpipe import models, testing

pytestmark = pytest.mark.slow  # every test compiles and runs pipelines

RATE = 0.1
CONFIG = models.GPTConfig(
    vocab_size=40, seq_len=8, num_layers=2, num_heads=2, d_model=16, d_ff=32, dropout=RATE
)
RTOL = 1e-5  # float32; as the compiler tests (see jpipe.testing.CheckResult)


def keyed_batch(rows: int, step: int = 3) -> dict:
    batch = models.example_batch(CONFIG, rows, seed=1)
    return {**batch, "keys": np.asarray(models.row_keys(7, step, rows))}


def whole_batch(model):
    """``(params, batch) -> (loss, grads)`` of the model on the whole batch, unpipelined."""
    return jax.jit(jax.value_and_grad(lambda p, b: jpipe.run_stages(model.stages, p, b)))


@pytest.mark.parametrize(
    "name,data,scan_layers",
    [("1f1b", 2, False), ("zb_h1", 1, True)],
)
@pytest.mark.parametrize("lowering", jpipe.LOWERINGS)
def test_pipelined_dropout_equals_the_whole_batch(name, data, scan_layers, lowering):
    config = models.GPTConfig(**{**CONFIG.__dict__, "scan_layers": scan_layers})
    schedule = jpipe.get_schedule(name, 2, 4)
    model = models.make_stages(config, (1, 1))
    params = model.init(0)
    batch = keyed_batch(16)
    pipe = jpipe.Pipeline(model.stages, schedule, jpipe.make_mesh(2, data), lowering=lowering)
    packed = pipe.pack(params)
    loss, grads = pipe.value_and_grad(packed, jax.device_put(batch, pipe.batch_sharding))
    # The reference runs the whole batch at once, unpipelined: equal only if
    # each row's masks depend on its key alone, not on its microbatch or shard.
    reference = whole_batch(model)
    want = reference(params, batch)
    _, rel = testing.compare((loss, pipe.unpack(grads)), want)
    assert rel <= RTOL, rel

    # The test can fail: with another step's keys the loss and gradients are
    # far from these, and so is the loss without dropout (no keys: evaluation).
    _, rel = testing.compare(reference(params, keyed_batch(16, step=4)), want)
    assert rel > 1000 * RTOL, rel
    no_keys = {k: v for k, v in batch.items() if k != "keys"}
    assert abs(float(jax.jit(model.loss)(params, no_keys)) - float(want[0])) > 1e-3


def test_keys_follow_the_row_not_the_split():
    rows = np.array([5, 0, 11, 3])
    whole = np.asarray(models.row_keys(7, 3, 16))
    np.testing.assert_array_equal(np.asarray(models.row_keys(7, 3, rows)), whole[rows])
    assert whole.dtype == np.uint32 and len({tuple(k) for k in whole}) == 16
    for seed, step in ((8, 3), (7, 4)):  # another seed or step: other keys
        assert not (np.asarray(models.row_keys(seed, step, 16)) == whole).all(axis=1).any()
    # A traced step (as inside the jitted train step) gives the same keys.
    traced = jax.jit(lambda s: models.row_keys(7, s, 16))(3)
    np.testing.assert_array_equal(np.asarray(traced), whole)

    # Each row's mask comes from its own key: one row alone gets its mask in the batch.
    x = np.ones((16, 32, 8), np.float32)
    dropped = np.asarray(models.row_dropout(x, whole, RATE))
    for r in (0, 9):
        alone = models.row_dropout(x[r : r + 1], whole[r : r + 1], RATE)
        np.testing.assert_array_equal(np.asarray(alone)[0], dropped[r])
    assert abs(float((dropped == 0).mean()) - RATE) < 0.02
    np.testing.assert_allclose(dropped[dropped != 0], 1 / (1 - RATE), rtol=1e-6)


def _code(keys):
    """A number in [0, 1) from each row's key, exact in float32 (0 at init)."""
    if keys is None:
        return np.zeros((1, 1), np.float32)
    return ((keys[:, 0] >> 8).astype(np.float32) / 2**24)[:, None]


class _Embed(nn.Module):
    @nn.compact
    def __call__(self, inputs, keys=None):
        return self.param("w", nn.initializers.ones, (1,)) * _code(keys)


class _Block(nn.Module):
    @nn.compact
    def __call__(self, x, keys=None):
        return x * 2 * self.param("w", nn.initializers.ones, (1,)) + _code(keys)


class _Head(nn.Module):
    @nn.compact
    def __call__(self, x, inputs, keys=None):
        return x * 2 * self.param("w", nn.initializers.ones, (1,)) + _code(keys)


@pytest.mark.parametrize("layers_per_stage,scan_layers", [((3,), False), ((1, 2), True)])
def test_each_module_gets_its_own_keys(layers_per_stage, scan_layers):
    # Modules that output their keys: the embedding gets the row keys with 0
    # folded in, block i with 1 + i (counted over the whole model, whatever the
    # split), the head with 1 + num_layers.
    example = {"tokens": np.zeros((1, 1), np.int32), "keys": np.zeros((1, 2), np.uint32)}
    model = models.split_flax_model(
        _Embed(),
        _Block(),
        _Head(),
        num_layers=3,
        layers_per_stage=layers_per_stage,
        example_inputs=example,
        scan_layers=scan_layers,
        keys="keys",
    )
    keys = np.asarray(models.row_keys(0, 0, 4))
    out = jpipe.run_stages(model.stages, model.init(0), {"tokens": keys[:, :1], "keys": keys})
    want = np.zeros((4, 1), np.float32)
    for module in range(5):  # embed, 3 blocks, head
        want = want * 2 + _code(np.asarray(models.fold_row_keys(keys, module)))
    np.testing.assert_allclose(np.asarray(out), want, rtol=1e-6)


def test_dropout_rate_is_checked():
    for bad in (1.0, -0.1, float("nan"), True):
        with pytest.raises(ValueError, match="GPTConfig.dropout"):
            models.GPTConfig(**{**CONFIG.__dict__, "dropout": bad})
    # Rate 0 ignores the keys, and a batch without keys (evaluation) draws
    # nothing: only a rate above 0 with keys puts random bits in the stage.
    plain = models.make_stages(models.GPTConfig(**{**CONFIG.__dict__, "dropout": 0.0}), (2,))
    dropping = models.make_stages(CONFIG, (2,))
    params = jax.eval_shape(lambda: plain.init(0))  # shapes are enough to trace
    batch = keyed_batch(2)
    no_keys = {k: v for k, v in batch.items() if k != "keys"}
    for model, inputs, draws in (
        (plain, batch, False),
        (dropping, no_keys, False),
        (dropping, batch, True),
    ):
        jaxpr = str(jax.make_jaxpr(model.stages[0])(params[0], None, inputs))
        assert ("random_bits" in jaxpr) == draws


def test_the_backward_stashes_no_mask():
    # A mask depends only on the row's key, an input, so F does not stash it:
    # I and W rebuild it from the key (`StageKernels.rebuilt_avals`), and the
    # block stage keeps exactly what it keeps without dropout.
    batch = keyed_batch(8)
    kept, rebuilt = [], []
    for rate in (0.0, RATE):
        model = models.make_stages(models.GPTConfig(**{**CONFIG.__dict__, "dropout": rate}), (1, 1))
        pipe = jpipe.Pipeline(model.stages, jpipe.get_schedule("1f1b", 2, 2), jpipe.make_mesh(2))
        pipe.packed_shapes(jax.eval_shape(lambda m=model: m.init(0)))  # sets the layout
        kernels = pipe.stage_kernels(batch)
        kept.append([k.res_layout.sizes for k in kernels])
        rebuilt.append([[a for a in k.rebuilt_avals if a.dtype == bool] for k in kernels])
    (plain_first, plain_block), (dropping_first, dropping_block) = kept
    assert dropping_block == plain_block
    assert dropping_first.get("bool", 0) == plain_first.get("bool", 0)
    masks = (4, CONFIG.seq_len, CONFIG.d_model)  # one site, one microbatch of 4 rows
    for plain, dropping, sites in zip(*rebuilt, (3, 2)):  # embedding + 2 in the block; 2
        assert [a.shape for a in dropping if a.shape == masks] == [masks] * sites
        assert not any(a.shape == masks for a in plain)
