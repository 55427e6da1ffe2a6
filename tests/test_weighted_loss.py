"""Exact weighted losses: a token-masked mean equals the full batch's masked mean.

The GPT's last stage returns `jpipe.WeightedLoss(total, weight)` when the batch
carries per-token ``weights``; the pipeline divides the summed totals by the
summed weights once, at the end. Compared with `jax.value_and_grad` of the
masked mean of the whole batch, unpipelined, in float32.
"""

import jax
import numpy as np
import pytest

import jpipe
from jpipe import models, testing

pytestmark = pytest.mark.slow  # every test compiles and runs pipelines

CONFIG = models.GPTConfig(vocab_size=40, seq_len=8, num_layers=4, num_heads=2, d_model=16, d_ff=32)
RTOL = 1e-5  # float32; as the compiler tests (see jpipe.testing.CheckResult)


def masked_batch(rows: int, seed: int = 3) -> dict:
    batch = models.example_batch(CONFIG, rows, seed)
    rng = np.random.default_rng(seed)
    # Very unequal masks: some sequences keep one token, some all of them, so
    # a mean of per-microbatch means would be far from the batch's masked mean.
    keep = rng.integers(1, CONFIG.seq_len + 1, size=rows)
    weights = (np.arange(CONFIG.seq_len)[None, :] < keep[:, None]).astype(np.float32)
    return {**batch, "weights": weights}


def sharp(params):
    # Initial weights make every token's loss about log(vocab); scaled up, the
    # losses differ from token to token, so how they are averaged matters (at 10
    # float32 itself loses 1e-4 of the gradients, pipelined or not).
    return jax.tree.map(lambda p: p * 3, params)


def full_batch_masked_mean(model, params, batch):
    out = jpipe.run_stages(model.stages, params, batch)
    assert isinstance(out, jpipe.WeightedLoss)
    return out.total / out.weight


@pytest.mark.parametrize(
    "name,ranks,microbatches,chunks,data",
    # With a data axis (and tensor and fsdp): tests/test_sharded.py.
    [("1f1b", 2, 4, 1, 1), ("zb_h1", 4, 4, 1, 1), ("interleaved_1f1b", 2, 4, 2, 1)],
)
@pytest.mark.parametrize("lowering", jpipe.LOWERINGS)
def test_masked_mean_matches_the_whole_batch(name, ranks, microbatches, chunks, data, lowering):
    schedule = jpipe.get_schedule(name, ranks, microbatches, chunks if chunks > 1 else None)
    S = schedule.num_stages
    model = models.make_stages(CONFIG, models.split_layers(CONFIG.num_layers, S))
    params = sharp(model.init(0))
    batch = masked_batch(4 * microbatches)
    pipe = jpipe.Pipeline(model.stages, schedule, jpipe.make_mesh(ranks, data), lowering=lowering)
    packed, placed = pipe.pack(params), jax.device_put(batch, pipe.batch_sharding)
    loss, grads = pipe.value_and_grad(packed, placed)
    want = jax.jit(jax.value_and_grad(lambda p: full_batch_masked_mean(model, p, batch)))(params)
    _, rel = testing.compare((loss, pipe.unpack(grads)), want)
    assert rel <= RTOL, rel
    if name == "1f1b":  # once: the forward-only loss and the checker's reference agree too
        np.testing.assert_allclose(pipe.loss(packed, placed), want[0], rtol=RTOL)
        ref = jpipe.reference_value_and_grad(model.stages, params, batch, microbatches)
        _, rel = testing.compare(ref, want)
        assert rel <= RTOL, rel


def test_the_masks_make_a_mean_of_means_wrong():
    # Guards the test above: with these masks the naive answer is far off.
    model = models.make_stages(CONFIG, (2, 2))
    params = sharp(model.init(0))
    batch = masked_batch(16)
    masked_mean = jax.jit(lambda b: full_batch_masked_mean(model, params, b))
    whole = masked_mean(batch)
    parts = jpipe.microbatches(batch, 4)
    means = [masked_mean(jax.tree.map(lambda a, m=m: a[m], parts)) for m in range(4)]
    assert abs(float(np.mean(means)) - float(whole)) > 100 * RTOL * abs(float(whole))
