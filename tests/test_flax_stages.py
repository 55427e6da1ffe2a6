"""Any Flax embed / block / head model, cut into stages by layer counts."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jpipe
from jpipe import testing
from jpipe.models import split_flax_model


class Embed(nn.Module):
    @nn.compact
    def __call__(self, inputs):
        return nn.Embed(16, 8)(inputs["tokens"])


class Block(nn.Module):
    @nn.compact
    def __call__(self, x):
        return x + nn.Dense(8)(nn.tanh(nn.Dense(16)(nn.LayerNorm()(x))))


class Head(nn.Module):
    @nn.compact
    def __call__(self, x, inputs):
        logits = nn.Dense(16)(x)
        logp = jax.nn.log_softmax(logits)
        return -jnp.mean(jnp.take_along_axis(logp, inputs["targets"][..., None], -1))


def _batch(rows):
    rng = np.random.default_rng(0)
    return {
        "tokens": rng.integers(0, 16, (rows, 5)).astype(np.int32),
        "targets": rng.integers(0, 16, (rows, 5)).astype(np.int32),
    }


def _model(layers_per_stage):
    return split_flax_model(
        Embed(),
        Block(),
        Head(),
        num_layers=14,
        layers_per_stage=layers_per_stage,
        example_inputs=_batch(2),
    )


@pytest.mark.slow
def test_uneven_split_runs_exactly_and_matches_other_splits():
    model = _model("3,4,4,3")
    params = model.init(0)
    assert [len(p.get("blocks", ())) for p in params] == [3, 4, 4, 3]
    batch = _batch(8)
    whole = _model("14")
    assert float(model.loss(params, batch)) == pytest.approx(
        float(whole.loss(whole.init(0), batch)), rel=1e-6
    )

    schedule = jpipe.get_schedule("1f1b", 4, 4)
    pipe = jpipe.Pipeline(model.stages, schedule, jpipe.make_mesh(4, 1))
    loss, grads = pipe.value_and_grad(pipe.pack(params), batch)
    ref_loss, ref_grads = jax.value_and_grad(model.loss)(params, batch)
    abs_err, rel_err = testing.compare((loss, pipe.unpack(grads)), (ref_loss, ref_grads))
    assert rel_err <= 1e-5, (abs_err, rel_err)


@pytest.mark.parametrize(
    "counts,message",
    [
        ("3,4,4", "sums to 11 but the model has num_layers=14"),
        ("3,0,8,3", r"middle stage\(s\) \[1\] would have no layer"),
        ("3;4", "must be comma-separated integers"),
    ],
)
def test_bad_layer_counts(counts, message):
    with pytest.raises(ValueError, match=message):
        _model(counts)


@pytest.mark.slow
@pytest.mark.parametrize("scan_layers", [False, True])
def test_init_of_some_stages_makes_only_those(scan_layers):
    # What each process of a multi-process run does: its own stages, with the
    # very values the whole init gives them; the others only as shapes.
    config = jpipe.models.GPTConfig(
        vocab_size=64,
        seq_len=8,
        num_layers=6,
        num_heads=2,
        d_model=16,
        d_ff=32,
        scan_layers=scan_layers,
    )
    model = jpipe.models.make_stages(config, (1, 2, 2, 1))
    full = model.init(0)
    for keep in ({1, 3}, {0}, {2}):
        part = model.init(0, stages=keep)
        for s in range(4):
            assert jax.tree.structure(part[s]) == jax.tree.structure(full[s])
            if s in keep:
                for a, b in zip(jax.tree.leaves(part[s]), jax.tree.leaves(full[s])):
                    np.testing.assert_array_equal(a, b)
            else:
                assert all(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(part[s]))
