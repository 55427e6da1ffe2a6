"""Sequence slices as microbatches (Seq1F1B): the language, the validator's carry rules,
the built-in, the CSV superset, and the SPMD lowering's refusal until it runs them. Pure
Python but for the last test."""

import itertools
import random

import pytest

import jpipe
from jpipe import B, F, Schedule, ScheduleError


def test_slices_are_a_count_or_lengths():
    rows = [[F(0, 0), F(0, 1), B(0, 1), B(0, 0)]]
    assert Schedule.of(rows, slices=2).slices == (1, 1)
    assert Schedule.of(rows, slices=(3, 1)).slices == (3, 1)
    assert Schedule.of(rows, slices=1).slices == () == Schedule.of(rows).slices
    assert Schedule.of(rows, slices=2) != Schedule.of(rows)  # slices are part of equality
    for bad, match in ((0, "positive number"), ((2,), "one slice"), ((1, 0), "positive integers")):
        with pytest.raises(ValueError, match=match):
            Schedule.of(rows, slices=bad)
    with pytest.raises(TypeError, match="number of even slices or their lengths"):
        Schedule.of(rows, slices=2.5)


def test_a_microbatch_is_a_slice_of_a_sequence():
    s = Schedule.of([[F(0, u) for u in range(6)] + [B(0, u) for u in (2, 1, 0, 5, 4, 3)]], slices=3)
    assert (s.num_microbatches, s.num_sequences, s.num_slices) == (6, 2, 3)
    assert [s.slice_of(u) for u in (0, 2, 3, 5)] == [(0, 0), (0, 2), (1, 0), (1, 2)]
    assert s.cell(F(0, 4)) == "0F1.1" and s.cell(B(0, 3)) == "0B1.0"
    jpipe.validate(s)
    assert "0F1.2" in str(s)


CARRY_CASES = {
    "a slice's forward before the slice before it": (
        [[F(0, 1), F(0, 0), B(0, 1), B(0, 0)]],
        r"\(F\(0,1\)\): comes before F\(0,0\) at position 1, the slice before it, whose carry",
    ),
    "a slice's backward before the slice after it": (
        [[F(0, 0), F(0, 1), B(0, 0), B(0, 1)]],
        r"\(B\(0,0\)\): comes before B\(0,1\) at position 3, the slice after it, which hands",
    ),
    "one sequence's slices of a stage on two ranks": (
        [[F(0, 0), B(0, 0)], [F(0, 1), B(0, 1)]],
        r"rank 1, position 0 \(F\(0,1\)\): on rank 1, but F\(0,0\), the slice before it of "
        "the same sequence, is on rank 0",
    ),
    "not whole sequences": (
        [[F(0, 0), F(0, 1), B(0, 1), B(0, 0), F(0, 2), B(0, 2)]],
        "but the lists have 3 microbatches, not whole sequences",
    ),
    "memory actions": (
        [[jpipe.FC(0, 0), F(0, 1), B(0, 1), jpipe.RECOMPUTE(0, 0), B(0, 0)]],
        "sequence slices with memory actions are not supported yet",
    ),
}


@pytest.mark.parametrize("rows,message", CARRY_CASES.values(), ids=list(CARRY_CASES))
def test_the_carry_rules_are_enforced_by_name(rows, message):
    with pytest.raises(ScheduleError, match=message):
        jpipe.validate(Schedule.of(rows, slices=2))


def test_the_split_backward_passes_the_carry_through_its_input_half():
    """With the backward split, the I (which passes the gradient upstream) keeps the
    reverse slice order; the W may run whenever its I has."""
    ok = [[F(0, 0), F(0, 1), jpipe.I(0, 1), jpipe.I(0, 0), jpipe.W(0, 0), jpipe.W(0, 1)]]
    jpipe.validate(Schedule.of(ok, slices=2))
    bad = [[F(0, 0), F(0, 1), jpipe.I(0, 0), jpipe.I(0, 1), jpipe.W(0, 1), jpipe.W(0, 0)]]
    with pytest.raises(ScheduleError, match=r"\(I\(0,0\)\): comes before I\(0,1\)"):
        jpipe.validate(Schedule.of(bad, slices=2))


@pytest.mark.parametrize("R,M,k", list(itertools.product((1, 2, 4, 8), (1, 3, 8), (2, 4))))
def test_seq1f1b_is_valid_with_the_papers_bubble_and_memory(R, M, k):
    schedule = jpipe.get_schedule("seq1f1b", R, M, slices=k)
    jpipe.validate(schedule, num_stages=R)
    assert schedule.slices == (1,) * k and schedule.num_sequences == M
    for r in range(R):
        actions = schedule.actions(r)
        assert sorted((a.kind, a.microbatch) for a in actions) == sorted(
            (kind, u) for kind in "FB" for u in range(M * k)
        )
    # a slice costs 1/k of a sequence: 1F1B's bubble with k times the microbatches
    sim = jpipe.simulate(schedule, jpipe.Costs(F=1 / k, B=2 / k))
    assert sim.bubble_fraction == pytest.approx((R - 1) / (M * k + R - 1), abs=1e-12)
    # rank 0 holds R + k - 1 slices at its peak, (R + k - 1) / k sequences against 1F1B's R
    assert sim.peak_activations[0] == min(M * k, R + k - 1)


def test_seq1f1b_takes_uneven_lengths():
    schedule = jpipe.get_schedule("seq1f1b:slices=4,lengths=(5,4,4,3)", 4, 2)
    assert schedule.slices == (5, 4, 4, 3)
    assert jpipe.get_schedule("seq1f1b", 4, 2, slices=2, lengths=(3, 1)).slices == (3, 1)
    with pytest.raises(ValueError, match=r"seq1f1b: 2 lengths \(3, 1\) for 4 slices"):
        jpipe.get_schedule("seq1f1b", 4, 2, lengths=(3, 1))


def test_the_csv_superset_names_each_cells_slice(tmp_path):
    schedule = jpipe.get_schedule("seq1f1b", 4, 2, slices=3)
    text = schedule.to_csv()
    assert text.splitlines()[3].startswith("3F0.0,3F0.1,3F0.2,3B0.2,3F1.0,3B0.1,")
    assert Schedule.from_csv_text(text) == schedule
    path = tmp_path / "seq.csv"
    schedule.to_csv(path)
    assert jpipe.get_schedule(str(path), 4, 2) == schedule  # 2 sequences, as asked
    # PyTorch runs whole sequences: a file for it is refused, naming the slices
    with pytest.raises(ValueError, match="each sequence is cut into 3 slices .*PyTorch's"):
        schedule.to_csv(pytorch=True)
    # uneven lengths are not in the file: writing refuses, reading takes them back
    uneven = jpipe.get_schedule("seq1f1b", 4, 2, slices=3, lengths=(2, 1, 1))
    with pytest.raises(ValueError, match=r"uneven slices \(2, 1, 1\) would read back even"):
        uneven.to_csv()
    assert Schedule.from_csv_text(text, slices=(2, 1, 1)) == uneven
    with pytest.raises(ValueError, match="cut each sequence into 3 slices, but slices=2"):
        Schedule.from_csv_text(text, slices=2)
    with pytest.raises(ValueError, match=r"row 1 column 4: cell '0B0' names no slice, where"):
        Schedule.from_csv_text("0F0.0,0F0.1,0B0.1,0B0\n")


def test_the_spmd_lowering_refuses_slices_by_name():
    # the per-rank lowering runs them (tests/test_slices_lowering.py)
    schedule = jpipe.get_schedule("seq1f1b", 2, 2, slices=2)
    with pytest.raises(ValueError, match="SPMD program does not run sequence slices yet"):
        jpipe.Pipeline([lambda p, x: x] * 2, schedule, jpipe.make_mesh(2, 1))


def random_sliced_schedule(seed: int, ranks: int, stages: int, sequences: int, k: int):
    """A random valid sliced schedule: each (stage, sequence) on a drawn rank, actions
    taken in a random order that any dependency allows (the carry's included), some
    backwards split into I and W."""
    rng = random.Random(seed)
    U = sequences * k
    at = {(s, q): rng.randrange(ranks) for s in range(stages) for q in range(sequences)}
    split = {(s, u): rng.random() < 0.5 for s in range(stages) for u in range(U)}
    todo = {key: ["F"] + (["I", "W"] if split[key] else ["B"]) for key in split}
    done, rows = set(), [[] for _ in range(ranks)]

    def ready(s, u, kind):
        if kind == "F":
            return (s == 0 or ("F", s - 1, u) in done) and (u % k == 0 or ("F", s, u - 1) in done)
        if kind == "W":
            return True
        later = u % k == k - 1 or ("G", s, u + 1) in done  # the carry's gradient
        return later and (s == stages - 1 or ("G", s + 1, u) in done)

    while todo:
        choices = [(key, kinds[0]) for key, kinds in todo.items() if ready(*key, kinds[0])]
        (s, u), kind = rng.choice(choices)
        rows[at[s, u // k]].append(jpipe.Action(kind, s, u))
        done.add((kind, s, u))
        if kind in "BI":
            done.add(("G", s, u))
        todo[s, u].pop(0)
        if not todo[s, u]:
            del todo[s, u]
    return Schedule.of(rows, slices=k)


@pytest.mark.parametrize("seed", range(40))
def test_random_sliced_schedules_are_valid_and_a_carry_out_of_order_is_not(seed):
    rng = random.Random(seed)
    R, S, Q, k = rng.randint(1, 4), rng.randint(1, 5), rng.randint(1, 3), rng.randint(2, 4)
    schedule = random_sliced_schedule(seed, R, S, Q, k)
    jpipe.validate(schedule, num_stages=S, num_microbatches=Q * k)
    sim = jpipe.simulate(schedule)
    assert all(b <= sim.makespan for b in sim.busy)
    # swap a sequence's two adjacent slices' forwards on one stage: the carry is read
    # before it is written, and the validator says so
    s, q, j = rng.randrange(S), rng.randrange(Q), rng.randrange(k - 1)
    first, second = F(s, q * k + j), F(s, q * k + j + 1)
    rows = [
        [second if a == first else first if a == second else a for a in row]
        for row in schedule.ranks
    ]
    with pytest.raises(ScheduleError, match="the slice before it"):
        jpipe.validate(Schedule.of(rows, slices=k))


@pytest.mark.parametrize(
    "lengths,implementation,block",
    [
        ((4, 4, 4, 4), "xla", None),
        ((6, 4, 4, 2), "xla", None),
        ((4, 4, 4, 4), "blockwise", 4),  # a tile a slice
        ((4, 4, 4, 4), "blockwise", 2),  # two tiles a slice
        ((6, 4, 4, 2), "blockwise", 2),
    ],
)
def test_attention_over_the_carry_chained_over_slices_is_the_whole_sequences(
    lengths, implementation, block
):
    """A sequence's slices, each attending over the keys and values its earlier slices
    left in the carry, give the whole sequence's causal attention and its gradients
    (grouped-query heads: 4 query heads on 2 key/value heads), as the masked dense
    product or blockwise (each slice's query tiles walking the key tiles up to theirs)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jpipe.models.attention import attention_over_carry, causal_attention

    B, L, H, G, K = 2, sum(lengths), 4, 2, 8
    keys = jax.random.split(jax.random.key(0), 4)
    q, k, v = (jax.random.normal(keys[i], (B, L, n, K)) for i, n in enumerate((H, G, G)))
    w = jax.random.normal(keys[3], (B, L, H, K))

    def whole(q, k, v):
        return jnp.sum(causal_attention(q, k, v) * w)

    def sliced(q, k, v):
        carry = (jnp.zeros((B, L, G, K)), jnp.zeros((B, L, G, K)))
        outs, start = [], 0
        for n in lengths:
            part = slice(start, start + n)
            out, carry = attention_over_carry(
                q[:, part], k[:, part], v[:, part], carry, start, implementation, block or 512
            )
            outs.append(out)
            start += n
        return jnp.sum(jnp.concatenate(outs, axis=1) * w)

    want, want_grads = jax.value_and_grad(whole, argnums=(0, 1, 2))(q, k, v)
    got, got_grads = jax.value_and_grad(sliced, argnums=(0, 1, 2))(q, k, v)
    np.testing.assert_allclose(got, want, rtol=1e-6)
    for g, h in zip(got_grads, want_grads, strict=True):  # measured: 2e-7 of the largest
        np.testing.assert_allclose(g, h, rtol=1e-6, atol=1e-6 * float(jnp.max(jnp.abs(h))))
