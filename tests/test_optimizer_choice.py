"""The optimizer and learning-rate schedule by name, the evaluation hook, honest throughput.

The optimizers are checked on small dicts laid out like the packed buckets
(``{bucket: [R, n]}``, a row per rank) against optax's own optimizers, with
no devices; one real run (the MLP-Mixer of examples/, whose batches are
``images`` and ``labels``, no ``tokens``) checks the config path, the
``eval_fn`` hook and the ``rows_per_s`` figure end to end.
"""

import json
from pathlib import Path

import jax
import ml_collections
import numpy as np
import optax
import pytest

from jpipe import train as trainer
from jpipe.train import loop as train_loop
from jpipe.train import optimizer as train_optimizer
from jpipe.train import sources

ROOT = Path(__file__).resolve().parents[1]


def opt_config(**changes) -> trainer.OptimizerConfig:
    fields = dict(
        learning_rate=0.1,
        warmup_steps=2,
        min_lr_ratio=0.1,
        weight_decay=0.1,
        b1=0.9,
        b2=0.95,
        grad_clip_norm=0.0,
    )
    return trainer.OptimizerConfig(**{**fields, **changes})


def buckets(seed: int) -> dict:
    """Two packed buckets of 3 ranks; rank 2 is padding in ``"a"`` (zero)."""
    a, b = jax.random.normal(jax.random.key(seed), (2, 3, 4))
    return {"a": a.at[2].set(0.0), "b": b}


def run_updates(optimizer, params, grads_list):
    state = optimizer.init(params)
    for grads in grads_list:
        updates, state = optimizer.update(grads, state, params)
        params = optax.apply_updates(params, updates)
    return params


GRADS = [buckets(s) for s in (1, 2, 3)]
ALL_ROWS = {"a": np.ones(3, bool), "b": np.ones(3, bool)}


@pytest.mark.slow
def test_adamw_is_the_earlier_optimizer_bit_for_bit():
    c = opt_config(grad_clip_norm=0.5)
    rows = {"a": np.array([True, False, False]), "b": np.array([False, True, True])}
    earlier = optax.chain(  # make_optimizer before optimizers had names
        optax.clip_by_global_norm(0.5),
        optax.scale_by_adam(b1=0.9, b2=0.95),
        train_optimizer.decay_by_row(0.1, rows),
        optax.scale_by_learning_rate(
            optax.warmup_cosine_decay_schedule(0.0, 0.1, 2, 10, end_value=0.1 * 0.1)
        ),
    )
    ours = train_optimizer.make_optimizer(c, 10, rows)
    jax.tree.map(
        np.testing.assert_array_equal,
        run_updates(ours, buckets(0), GRADS),
        run_updates(earlier, buckets(0), GRADS),
    )


@pytest.mark.parametrize(
    "name, reference",
    [
        # torch.optim.Adam's weight_decay: added to the gradient, before Adam.
        ("adam", lambda lr, c: optax.adam(lr, b1=c.b1, b2=c.b2)),
        ("sgd", lambda lr, c: optax.sgd(lr, momentum=c.momentum)),
        ("lion", None),  # optax.lion decays the weights itself (decoupled)
    ],
)
def test_each_optimizer_is_optaxs_own(name, reference):
    c = opt_config(name=name, lr_schedule="warmup_linear", learning_rate=0.01)
    schedule = train_optimizer.learning_rate_schedule(c, 10)
    ours = run_updates(train_optimizer.make_optimizer(c, 10, ALL_ROWS), buckets(0), GRADS)
    if reference is None:
        theirs_opt = optax.lion(schedule, b1=c.b1, b2=c.b2, weight_decay=c.weight_decay)
        theirs = run_updates(theirs_opt, buckets(0), GRADS)
    else:  # the decay as L2: the gradient plus weight_decay * params, by hand
        theirs_opt = reference(schedule, c)
        params, state = buckets(0), theirs_opt.init(buckets(0))
        for grads in GRADS:
            l2 = jax.tree.map(lambda g, p: g + c.weight_decay * p, grads, params)
            updates, state = theirs_opt.update(l2, state, params)
            params = optax.apply_updates(params, updates)
        theirs = params
    jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, rtol=1e-6, atol=1e-7), ours, theirs)


@pytest.mark.parametrize("name", train_optimizer.OPTIMIZERS)
def test_every_optimizer_keeps_padding_zero(name):
    # Rank 2's row of "a" is padding: zero parameters, zero gradients, no decay.
    rows = {"a": np.array([True, True, False]), "b": np.ones(3, bool)}
    c = opt_config(name=name, grad_clip_norm=0.5)
    params = run_updates(train_optimizer.make_optimizer(c, 10, rows), buckets(0), GRADS)
    assert not np.asarray(params["a"][2]).any()
    assert np.asarray(params["a"][:2]).all() and np.asarray(params["b"]).all()


def test_clipping_is_over_all_buckets_for_every_optimizer():
    # Plain SGD at a constant rate shows the clip itself: the update is the
    # gradient scaled by max_norm / (norm over both buckets together).
    c = opt_config(
        name="sgd",
        momentum=0.0,
        lr_schedule="constant",
        warmup_steps=0,
        weight_decay=0.0,
        grad_clip_norm=0.5,
    )
    grads = GRADS[0]
    norm = float(optax.tree.norm(grads))
    assert norm > 0.5
    optimizer = train_optimizer.make_optimizer(c, 10, ALL_ROWS)
    updates, _ = optimizer.update(grads, optimizer.init(buckets(0)), buckets(0))
    expected = jax.tree.map(lambda g: -0.1 * g * 0.5 / norm, grads)
    jax.tree.map(lambda u, e: np.testing.assert_allclose(u, e, rtol=1e-6), updates, expected)


def test_learning_rate_schedules():
    steps = 12
    linear = train_optimizer.learning_rate_schedule(opt_config(lr_schedule="warmup_linear"), steps)
    assert [float(linear(s)) for s in (0, 1, 2)] == pytest.approx([0.0, 0.05, 0.1])
    assert float(linear(7)) == pytest.approx((0.1 + 0.01) / 2)  # halfway down
    assert float(linear(steps)) == pytest.approx(0.01)  # min_lr_ratio of the peak
    constant = train_optimizer.learning_rate_schedule(opt_config(lr_schedule="constant"), steps)
    assert [float(constant(s)) for s in (0, 1, 2, 11)] == pytest.approx([0.0, 0.05, 0.1, 0.1])
    flat = train_optimizer.learning_rate_schedule(
        opt_config(lr_schedule="constant", warmup_steps=0), steps
    )
    assert float(flat(0)) == pytest.approx(0.1)
    cosine = train_optimizer.learning_rate_schedule(opt_config(), steps)
    reference = optax.warmup_cosine_decay_schedule(0.0, 0.1, 2, steps, end_value=0.01)
    assert [float(cosine(s)) for s in range(steps + 1)] == [
        float(reference(s)) for s in range(steps + 1)
    ]


def default_config():
    return trainer.config_from_file(ROOT / "configs" / "default.py")


@pytest.mark.parametrize(
    "field, value, choices",
    [
        ("name", "adagrad", "adamw, adam, sgd, lion"),
        ("lr_schedule", "cosine", "warmup_cosine, warmup_linear, constant"),
    ],
)
def test_an_unknown_name_is_refused_with_the_choices(field, value, choices):
    config = default_config()
    config.optimizer[field] = value
    with pytest.raises(trainer.ConfigError) as e:
        trainer.TrainConfig.from_config(config)
    assert str(e.value) == f"config.optimizer.{field}={value!r}: must be one of {choices}"


def test_an_eval_fn_that_names_no_file_function_is_refused():
    config = default_config()
    config.eval_fn = "accuracy"
    with pytest.raises(trainer.ConfigError, match=r"^config.eval_fn='accuracy': must be path/"):
        trainer.TrainConfig.from_config(config)


def test_what_states_tokens_per_row():
    """The corpus states model.seq_len; a source only what it or the config says."""
    config = default_config()
    config.data.max_bytes = 32768
    assert train_loop._tokens_per_row(trainer.prepare(config)) == 64
    config.data.tokens_per_row = 32
    with pytest.raises(trainer.ConfigError, match="accepted: 0 or 64"):
        train_loop._tokens_per_row(trainer.prepare(config))

    class Stated:
        tokens_per_row = 7

        def batch_at(self, step, process_index=0, process_count=1):
            return {"x": np.zeros((4, 3), np.float32)}

    args = sources.DataArgs(ml_collections.FrozenConfigDict({}), "train", 4, 0)
    stated = sources.SourceBatches(lambda a: Stated(), args, "stated")
    stated.batch_at(0)
    assert stated.tokens_per_row == 7
    silent = sources.SourceBatches(
        lambda a: iter([{"tokens": np.zeros((4, 16), np.int32)}]), args, "silent"
    )
    silent.batch_at(0)
    assert silent.tokens_per_row is None  # a "tokens" leaf is not a statement

    Stated.tokens_per_row = 0
    with pytest.raises(ValueError, match="tokens_per_row is 0; it must be a positive int"):
        sources.SourceBatches(lambda a: Stated(), args, "bad").batch_at(0)


EVAL_FN = """
import importlib.util

import jax
import ml_collections

from jpipe import models

_spec = importlib.util.spec_from_file_location("mixer_for_eval", {mixer!r})
mixer = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(mixer)
model = mixer.build(models.BuildArgs(ml_collections.FrozenConfigDict({model!r}), 2))


def figures(params, batch):
    arrays = all(isinstance(x, jax.Array) for x in jax.tree.leaves(params))
    return {{
        "reference_loss": model.loss(params, batch),  # outside the pipeline
        "rows": batch["labels"].shape[0],
        "arrays": float(arrays),
    }}
"""


@pytest.mark.slow
def test_eval_fn_and_rows_per_second_on_a_batch_without_tokens(tmp_path, capsys):
    mixer = ROOT / "examples" / "mixer_jax.py"
    config = trainer.config_from_file(mixer)
    config.mesh.pipe, config.mesh.data = 2, 1
    config.num_microbatches, config.batch_size = 2, 8
    config.steps, config.log_every, config.eval_every, config.eval_batches = 2, 1, 2, 2
    config.model.num_layers = 2
    config.optimizer.name, config.optimizer.lr_schedule = "sgd", "constant"
    config.optimizer.warmup_steps = 0
    model = {k: v for k, v in config.model.to_dict().items() if k != "name"}
    (tmp_path / "figures.py").write_text(EVAL_FN.format(mixer=str(mixer), model=model))
    config.eval_fn = f"{tmp_path / 'figures.py'}:figures"

    result = trainer.train(config, str(tmp_path / "run"), progress=False)

    out = capsys.readouterr().out
    assert sorted(result.eval_figures) == [0, 2]
    for step, figures in result.eval_figures.items():
        # The hook saw the trained parameters and the held-out batches the
        # pipeline's own loss saw: the unpipelined loss agrees with it (float32,
        # as tests/test_train.py's RTOL).
        np.testing.assert_allclose(
            figures["eval_reference_loss"], result.eval_losses[step], rtol=1e-5
        )
        assert figures["eval_rows"] == 8 and figures["eval_arrays"] == 1.0
    assert result.tokens_per_second is None and result.rows_per_second > 0
    assert "rows/s" in out and "tokens/s" not in out

    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").open()]
    steps = [r for r in records if "loss" in r]
    assert [r["step"] for r in steps] == [1, 2]
    for r in steps:
        assert "tokens_per_s" not in r
        assert r["rows_per_s"] == pytest.approx(8 / r["step_time"], rel=1e-12)
        assert r["lr"] == pytest.approx(config.optimizer.learning_rate)  # sgd, constant
    assert {r["step"] for r in records if "eval_reference_loss" in r} == {0, 2}
    seen = tensorboard_scalars(tmp_path / "run" / "tensorboard")
    for r in records:
        for key in ("rows_per_s", "eval_reference_loss", "eval_rows"):
            if key in r:
                assert seen[(key, r["step"])] == pytest.approx(r[key], rel=1e-6)
    assert not [tag for tag, _ in seen if tag == "tokens_per_s"]


def tensorboard_scalars(logdir) -> dict:
    """``{(tag, step): value}`` from a run's event file (TFRecord framing, as test_train.py)."""
    import struct

    from tensorboardX.proto import event_pb2

    (events,) = Path(logdir).glob("events.out.tfevents.*")
    data, i, seen = events.read_bytes(), 0, {}
    while i < len(data):  # length, its CRC, the record, its CRC
        (n,) = struct.unpack("<Q", data[i : i + 8])
        event = event_pb2.Event()
        event.ParseFromString(data[i + 12 : i + 12 + n])
        i += 12 + n + 4
        for value in event.summary.value:
            seen[(value.tag, event.step)] = value.simple_value
    return seen
