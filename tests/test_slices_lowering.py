"""Sequence slices run by the per-rank lowering: stages that carry causal attention's keys
and values from one slice of a sequence to the next give the loss and every gradient
of the model on whole sequences (tests/test_slices.py has the language and validator).
"""

import random

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_mpmd import measure_each_op
from test_slices import random_sliced_schedule

import jpipe
from jpipe import testing
from jpipe.models.attention import attention_over_carry

WIDTH, TOKENS = 8, 12


def attention_stage(params, x, inputs, carry):
    """One attention layer over the carry (its keys and values), and a residual MLP.

    The first stage reads the batch's features; the slice's first token is its
    place in the sequence (`inputs["pos"]`)."""
    h = inputs["x"] if x is None else x
    q, k, v = (jnp.einsum("btd,de->bte", h, params[n])[:, :, None] for n in "qkv")
    out, carry = attention_over_carry(q, k, v, carry, inputs["pos"][0, 0])
    h = h + jnp.tanh(out[:, :, 0] @ params["o"])
    return h + jnp.tanh(h @ params["m"]), carry


def mlp_stage(params, x, inputs):
    """A stage that reads no other token: no carry."""
    return x + jnp.tanh(x @ params["m"])


def loss_stage(params, x, inputs, carry):
    """Attention again, then the slice's mean squared error: a carried last stage."""
    h, carry = attention_stage(params, x, inputs, carry)
    return jnp.mean((h @ params["out"] - inputs["y"]) ** 2), carry


def model(num_stages: int, carried_middle: bool = True):
    """Stages and their parameters: attention first and last, between them attention
    (or, with ``carried_middle=False``, every other one an MLP without a carry)."""
    keys = iter(jax.random.split(jax.random.key(1), 8 * num_stages))

    def w():
        return jax.random.normal(next(keys), (WIDTH, WIDTH)) / np.sqrt(WIDTH)

    stages, params, carried = [], [], []
    for s in range(num_stages):
        p = {n: w() for n in "qkvom"}
        if s == num_stages - 1:
            stages.append(loss_stage)
            p["out"] = w()
            carried.append(True)
        elif carried_middle or s % 2 == 0:
            stages.append(attention_stage)
            carried.append(True)
        else:
            stages.append(mlp_stage)
            p = {"m": w()}
            carried.append(False)
        params.append(p)
    return stages, params, carried


def batch_of(rows: int):
    keys = jax.random.split(jax.random.key(2), 2)
    pos = np.broadcast_to(np.arange(TOKENS, dtype=np.int32), (rows, TOKENS))
    return {
        "x": jax.random.normal(keys[0], (rows, TOKENS, WIDTH)),
        "y": jax.random.normal(keys[1], (rows, TOKENS, WIDTH)),
        "pos": jnp.asarray(pos),
    }


def carries_of(carried, rows: int):
    """Each carried stage's keys and values over the whole sequence, for one slice's rows."""
    kv = jax.ShapeDtypeStruct((rows, TOKENS, 1, WIDTH), jnp.float32)
    return [(kv, kv) if c else None for c in carried]


def whole_sequence(stages, carried):
    """The model on whole sequences: each carried stage with zeros for its carry."""

    def plain(fn, c):
        if not c:
            return fn

        def stage(params, x, inputs):
            rows = inputs["x"].shape[0]
            zeros = jnp.zeros((rows, TOKENS, 1, WIDTH))
            return fn(params, x, inputs, (zeros, zeros))[0]

        return stage

    return [plain(fn, c) for fn, c in zip(stages, carried, strict=True)]


def run_both(schedule, data: int = 1, carried_middle: bool = True, rows_per_sequence: int = 2):
    """The sliced pipeline's loss and gradients, and the whole-sequence model's."""
    S, M = schedule.num_stages, schedule.num_sequences
    stages, params, carried = model(S, carried_middle)
    rows = rows_per_sequence * M * data
    batch = batch_of(rows)
    pipe = jpipe.Pipeline(
        stages,
        schedule,
        jpipe.make_mesh(schedule.num_ranks, data),
        lowering="mpmd",
        carries=carries_of(carried, rows_per_sequence),
    )
    batch = jax.device_put(batch, pipe.batch_sharding)
    loss, grads = pipe.value_and_grad(pipe.pack(params), batch)
    want = jpipe.reference_value_and_grad(whole_sequence(stages, carried), params, batch, M)
    return pipe, params, batch, (loss, pipe.unpack(grads)), want


@pytest.mark.parametrize(
    "ranks,sequences,k,data,carried_middle",
    [
        (2, 2, 2, 1, True),
        pytest.param(4, 2, 4, 1, False, marks=pytest.mark.slow),
        (2, 3, 2, 2, True),
    ],
)
def test_seq1f1b_is_the_whole_sequences_model(ranks, sequences, k, data, carried_middle):
    schedule = jpipe.get_schedule("seq1f1b", ranks, sequences, slices=k)
    *_, got, want = run_both(schedule, data, carried_middle)
    _, rel = testing.compare(got, want)
    assert rel < 1e-5, rel
    assert abs(float(got[0]) - float(want[0])) <= 1e-6 * abs(float(want[0]))


@pytest.mark.parametrize("seed", [0] + [pytest.param(s, marks=pytest.mark.slow) for s in (1, 2, 3)])
def test_random_sliced_schedules_are_the_whole_sequences_model(seed):
    """Drawn placements (a stage's sequences on different ranks), split backwards and
    slices in any order the carry allows."""
    rng = random.Random(seed)
    R, S, Q, k = rng.randint(1, 3), rng.randint(1, 4), rng.randint(1, 2), rng.randint(2, 3)
    schedule = random_sliced_schedule(seed, R, S, Q, k)
    if schedule.num_ranks != R or any(not row for row in schedule.ranks):
        pytest.skip("a drawn rank got no work")  # the mesh needs every rank to hold a stage
    *_, got, want = run_both(schedule)
    _, rel = testing.compare(got, want)
    assert rel < 1e-5, (schedule, rel)


def test_the_forward_only_loss_carries_too():
    schedule = jpipe.get_schedule("seq1f1b", 2, 2, slices=4)
    pipe, params, batch, got, want = run_both(schedule)
    assert float(pipe.loss(pipe.pack(params), batch)) == pytest.approx(float(want[0]), rel=1e-6)


def test_the_accounted_values_count_the_carries():
    """After every op, each device holds what `held_values` says: the carries and their
    gradients among them."""
    schedule = jpipe.get_schedule("seq1f1b", 2, 2, slices=2)
    pipe, params, batch, *_ = run_both(schedule)
    programs, measured = measure_each_op(pipe, params, batch)
    held, accounts, made = programs.held_values(), programs.account(), programs.accumulators_made()
    carry_bytes = 2 * 2 * TOKENS * WIDTH * 4  # keys and values of 2 rows
    assert any(h[0] >= carry_bytes for h in held)
    for i, per_rank in enumerate(measured):
        for r, per_device in enumerate(per_rank):
            want = held[i][r] + (accounts[r].grad_bytes if i >= made[r] else 0)
            assert per_device == [want] * len(per_device), (i, programs.order[i], r)


def test_what_cannot_run_is_refused_by_name():
    schedule = jpipe.get_schedule("seq1f1b", 2, 2, slices=2)
    stages, params, carried = model(2)
    mesh = jpipe.make_mesh(2, 1)
    carries = carries_of(carried, 2)
    with pytest.raises(ValueError, match="SPMD program does not run sequence slices yet"):
        jpipe.Pipeline(stages, schedule, mesh, carries=carries)
    with pytest.raises(ValueError, match="got 1 carries for 2 stages"):
        jpipe.Pipeline(stages, schedule, mesh, lowering="mpmd", carries=carries[:1])
    whole = jpipe.get_schedule("1f1b", 2, 2)
    with pytest.raises(ValueError, match="does not slice its sequences"):
        jpipe.Pipeline(stages, whole, mesh, lowering="mpmd", carries=carries)
    uneven = jpipe.get_schedule("seq1f1b", 2, 2, slices=2, lengths=(3, 1))
    pipe = jpipe.Pipeline(stages, uneven, mesh, lowering="mpmd", carries=carries)
    with pytest.raises(ValueError, match=r"even slices only for now.*\(3, 1\)"):
        pipe.value_and_grad(pipe.pack(params), batch_of(4))
    # a stage that returns another carry than it was given (its keys alone)

    def keys_only(params, x, inputs, carry):
        y, (keys, _) = attention_stage(params, x, inputs, carry)
        return y, keys

    pipe = jpipe.Pipeline([keys_only, stages[1]], schedule, mesh, lowering="mpmd", carries=carries)
    with pytest.raises(ValueError, match=r"stage 0 returns a carry of float32\[2, 12, 1, 8\] but"):
        pipe.value_and_grad(pipe.pack(params), batch_of(4))
    # an integer carry
    ints = [(jax.ShapeDtypeStruct((2,), jnp.int32)), None]

    def counting(params, x, inputs, carry):
        return attention_stage(params, x, inputs, (jnp.zeros((2, TOKENS, 1, WIDTH)),) * 2)[0], carry

    pipe = jpipe.Pipeline([counting, mlp_stage], schedule, mesh, lowering="mpmd", carries=ints)
    with pytest.raises(ValueError, match="stage 0's carry is int32: a carry must be floating"):
        pipe.value_and_grad(pipe.pack([params[0], {"m": params[1]["m"]}]), batch_of(4))
    # tokens the slices do not divide
    pipe = jpipe.Pipeline(stages, schedule, mesh, lowering="mpmd", carries=carries)
    odd = jax.tree.map(lambda a: a[:, :11], batch_of(4))
    with pytest.raises(ValueError, match=r"batch\['pos'\] has shape \(4, 11\).*2 slices"):
        pipe.value_and_grad(pipe.pack(params), odd)


@pytest.mark.parametrize("slices,data", [(2, 1), (3, 2)])
def test_check_schedule_runs_seq1f1b_on_its_sliced_model(slices, data):
    """`python -m jpipe.check seq1f1b --lowering mpmd`'s path: the checker's own carried
    model (`jpipe.testing.sliced_model`) against whole sequences."""
    result = testing.check_schedule("seq1f1b", 2, 2, lowering="mpmd", data=data, slices=slices)
    assert result.passed, result
    assert result.model.startswith("sliced_model")
    assert result.max_rel_err < 1e-5


@pytest.mark.slow
@pytest.mark.parametrize(
    "family,tensor,attention",
    [
        ("gpt", 1, "xla"),
        ("gpt", 2, "xla"),
        ("llama", 1, "xla"),
        ("llama", 2, "xla"),
        ("llama", 2, "blockwise"),  # tiles of 2 tokens, two a slice
    ],
)
def test_the_transformers_sliced_are_themselves_on_whole_sequences(family, tensor, attention):
    """The GPT's and Llama's blocks carry their keys and values from slice to slice
    (`StagedModel.carries`); the GPT's embedding reads the slice's ``positions``, the
    Llama's rotations start at the slice's first token. seq1f1b gives the loss and
    gradients of the model on whole sequences, heads split over ``tensor`` too
    (Llama: grouped-query, 4 query heads on 2 key/value heads)."""
    from jpipe import models
    from jpipe.models import gpt, llama

    L = 16
    if family == "gpt":
        module = gpt
        config = gpt.GPTConfig(
            vocab_size=64, num_layers=4, d_model=32, num_heads=4, seq_len=L, d_ff=64
        )
    else:
        module = llama
        config = models.LlamaConfig(
            vocab_size=64,
            seq_len=L,
            num_layers=4,
            num_heads=4,
            num_kv_heads=2,
            d_model=32,
            d_ff=64,
            attention=attention,
            attention_block=2,
        )
    schedule = jpipe.get_schedule("seq1f1b", 2, 2, slices=4)
    whole = module.make_stages(config, (2, 2))
    model = module.make_stages(config, (2, 2), tensor_axis="tensor" if tensor > 1 else None)
    params = whole.init(0)
    batch = models.example_batch(config, batch_size=4, seed=1)
    positions = np.broadcast_to(np.arange(L, dtype=np.int32), (4, L))
    pipe = jpipe.Pipeline(
        model.stages,
        schedule,
        jpipe.make_mesh(2, 1, tensor=tensor),
        lowering="mpmd",
        carries=model.carries(2, L, tensor),
    )
    specs = module.tensor_specs(config, params) if tensor > 1 else None
    sliced = jax.device_put(dict(batch, positions=np.array(positions)), pipe.batch_sharding)
    loss, grads = pipe.value_and_grad(pipe.pack(params, specs), sliced)
    want = jpipe.reference_value_and_grad(whole.stages, params, batch, 2)
    _, rel = testing.compare((loss, pipe.unpack(grads)), want)
    assert rel < 1e-5, rel


@pytest.mark.slow
def test_the_trainer_runs_seq1f1b_to_the_losses_of_whole_sequences(tmp_path):
    """`train.py --config.schedule=seq1f1b:slices=4 --config.lowering=mpmd`: each step's
    loss and the held-out loss those of 1F1B on whole sequences (test_mpmd.py's
    per-rank run, data 2); what the trainer cannot run sliced is refused by name."""
    from test_train import tiny_config

    from jpipe import train as trainer
    from jpipe.train.config import ConfigError

    def run(schedule, **more):
        overrides = {"lowering": "mpmd", "schedule": schedule, "model.dropout": 0.0, **more}
        config = tiny_config(steps=4, eval_every=0, **overrides)
        return trainer.train(config, str(tmp_path / schedule), progress=False)

    sliced, whole = run("seq1f1b:slices=4"), run("1f1b")
    assert sorted(sliced.losses) == [1, 2, 3, 4]
    np.testing.assert_allclose(
        [sliced.losses[s] for s in (1, 2, 3, 4)], [whole.losses[s] for s in (1, 2, 3, 4)], rtol=1e-5
    )
    np.testing.assert_allclose(sliced.eval_losses[4], whole.eval_losses[4], rtol=1e-5)
    for overrides, match in (
        ({"lowering": "spmd"}, "SPMD program does not run sequence slices yet"),
        ({"model.dropout": 0.1}, "dropout does not take sequence slices yet"),
        ({"model.scan_layers": True}, "scan_layers and sequence_parallel do not take"),
    ):
        config = tiny_config(
            steps=1, schedule="seq1f1b:slices=4", **{"lowering": "mpmd", **overrides}
        )
        with pytest.raises(ConfigError, match=match):
            trainer.train(config, str(tmp_path / "refused"), progress=False)
