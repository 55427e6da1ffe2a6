"""Property tests: random valid schedules run exactly; broken ones are refused.

A random valid schedule comes from a random placement of stages on ranks, a
random choice of B or I+W for every backward, and a random order of all
actions that respects the dependencies (so no rank can deadlock). Every one
must give the unpipelined loss and gradients, with the checker's model
unrolled or with its blocks in `lax.scan` (whose backward is split into an
I-scan and a W-scan), with a random pytree of float32, bfloat16 and float16
leaves passed across each stage boundary, and with or without a data axis of
2 beside the pipe axis, under either lowering (`jpipe.LOWERINGS`), with
residuals randomly recomputed, evicted to another rank or offloaded to the
host, with stages replicated on two ranks (each microbatch on one of them:
under both lowerings); and with stages that write their own collectives
over tensor, on meshes with tensor, fsdp and data axes. A corrupted one (an action
dropped, duplicated, or two swapped on a rank) must either be refused with a
ScheduleError or, where the swap left it valid, still be exact.
"""

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import jpipe
from jpipe import testing


def random_schedule(
    seed: int,
    ranks: int,
    stages: int,
    microbatches: int,
    memory: bool = False,
    overlap: bool = False,
    replicas: bool = False,
) -> jpipe.Schedule:
    """A random valid schedule; with `memory`, residuals kept, recomputed, evicted, offloaded.

    With `replicas`, about half of the stages get a second rank, and each of
    their microbatches runs on one of the two, drawn (a stage may end up
    with all of them on one).

    With `overlap`, about half of the places where a rank's F is followed by a
    B or I become `Overlap` cells (the rest of the schedule as without it).
    """
    rng = random.Random(seed)
    owner = [rng.randrange(ranks) for _ in range(stages)]
    split = {(s, m): rng.random() < 0.5 for s in range(stages) for m in range(microbatches)}
    second = [
        rng.randrange(ranks) if replicas and ranks > 1 and rng.random() < 0.5 else owner[s]
        for s in range(stages)
    ]
    # The rank of each (stage, microbatch): its stage's, or its stage's second
    # (drawn only with replicas, so that the other draws stay as they were).
    at = {
        (s, m): rng.choice((owner[s], second[s])) if second[s] != owner[s] else owner[s]
        for (s, m) in split
    }
    modes = ["keep", "recompute", "offload"] + (["evict"] * (ranks > 1))
    mode = {key: rng.choice(modes) if memory else "keep" for key in split}
    partner = {
        (s, m): rng.choice([q for q in range(ranks) if q != at[(s, m)]])
        for (s, m) in split
        if mode[(s, m)] == "evict"
    }
    done: set = set()
    rows: list[list] = [[] for _ in range(ranks)]
    # The next action of each (stage, microbatch): F, then B or I, then W.
    todo = {(s, m): ["F"] + (["I", "W"] if split[(s, m)] else ["B"]) for (s, m) in split}

    def ready(s, m, kind):
        if kind == "F":
            return s == 0 or ("F", s - 1, m) in done
        if kind == "W":
            return True  # its I ran: it was before W in the same list
        return s == stages - 1 or ("G", s + 1, m) in done

    while todo:
        choices = [(key, kinds[0]) for key, kinds in todo.items() if ready(*key, kinds[0])]
        (s, m), kind = rng.choice(choices)
        row, how, A = rows[at[(s, m)]], mode[(s, m)], jpipe.Action
        if kind in "BI":  # the residuals back on the rank before their reader
            if how == "recompute":
                row.append(A("RECOMPUTE", s, m))
            elif how == "evict":
                row.append(A("LOAD", s, m, partner[(s, m)]))
            elif how == "offload":
                row += [A("RELOAD_START", s, m), A("RELOAD_END", s, m)]
        row.append(A("FC" if kind == "F" and how == "recompute" else kind, s, m))
        if kind == "F" and how == "evict":  # and away from it until then
            row.append(A("EVICT", s, m, partner[(s, m)]))
        elif kind == "F" and how == "offload":
            row += [A("OFFLOAD_START", s, m), A("OFFLOAD_END", s, m)]
        done.add(("F" if kind == "F" else "G" if kind in "BI" else "W", s, m))
        todo[(s, m)].pop(0)
        if not todo[(s, m)]:
            del todo[(s, m)]
    if overlap:
        cells = random.Random(seed + 1)
        rows = [_with_cells(row, cells) for row in rows]
    return jpipe.Schedule.of(rows, name=f"random-{seed}")


def _with_cells(row: list, rng: random.Random) -> list:
    """`row` with about half of its ``F`` then ``B``/``I`` pairs as `Overlap` cells."""
    out, i = [], 0
    while i < len(row):
        a = row[i]
        pair = i + 1 < len(row) and a.kind == "F" and row[i + 1].kind in ("B", "I")
        if pair and rng.random() < 0.5:
            out.append(jpipe.Overlap(a, row[i + 1]))
            i += 2
        else:
            out.append(a)
            i += 1
    return out


def test_random_cells_are_drawn_whole_and_split():
    # The fuzz's cells: some issued as one program by the per-rank lowering,
    # some split there because the backward needs what the forward starts.
    from jpipe.lower.mpmd.programs import issue_ops

    fused = split = 0
    for seed in range(200):
        ranks, stages, microbatches = 1 + seed % 3, 1 + seed % 4, 1 + seed % 3
        schedule = random_schedule(seed, ranks, max(ranks, stages), microbatches, overlap=True)
        jpipe.validate(schedule)
        written = sum(isinstance(c, jpipe.Overlap) for row in schedule.ranks for c in row)
        cells = len(issue_ops(schedule).cells)
        fused, split = fused + cells, split + written - cells
        plain = random_schedule(seed, ranks, max(ranks, stages), microbatches)
        assert [plain.actions(r) for r in range(ranks)] == [
            schedule.actions(r) for r in range(ranks)
        ]
    assert fused > 50 and split > 10, (fused, split)


def test_random_schedules_with_memory_actions_validate():
    # The fuzz's memory actions are placed where the validator accepts them,
    # and every kind turns up.
    kinds = set()
    for seed in range(200):
        ranks, stages, microbatches = 1 + seed % 3, 1 + seed % 4, 1 + seed % 3
        schedule = random_schedule(seed, ranks, max(ranks, stages), microbatches, memory=True)
        jpipe.validate(schedule)
        kinds |= {a.kind for _, _, a in schedule.all_actions() if a.is_memory}
    assert kinds == set(jpipe.MEMORY_KINDS)


sizes = st.tuples(
    st.integers(0, 2**31), st.integers(1, 3), st.integers(1, 4), st.integers(1, 4)
).map(lambda t: (t[0], t[1], max(t[1], t[2]), t[3]))

slow = settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])


# One kind per boundary, for up to 4 stages; a model uses the first `stages - 1`.
activations = st.tuples(*[st.sampled_from(testing.ACTIVATIONS)] * 3)


@pytest.mark.slow
@slow
@given(
    sizes,
    st.sampled_from(["unit", "packed"]),
    st.booleans(),
    activations,
    st.sampled_from([1, 2]),
    st.sampled_from(jpipe.LOWERINGS),
    st.booleans(),
    st.booleans(),
    st.booleans(),
)
def test_random_valid_schedules_are_exact(
    size, layout, scan_layers, kinds, data, lowering, memory, overlap, replicas
):
    # Memory actions (recompute, evict, offload) are drawn under both
    # lowerings; the SPMD one lays them out in unit ticks only. Overlap cells
    # too: the per-rank lowering runs each as one program where it can.
    # Replicated stages too, under both.
    seed, ranks, stages, microbatches = size
    assert ranks * data <= 8  # the fake devices of conftest.py
    schedule = random_schedule(
        seed, ranks, stages, microbatches, memory=memory, overlap=overlap, replicas=replicas
    )
    jpipe.validate(schedule)
    if schedule.has_memory_actions and lowering == "spmd":
        layout = "unit"
    kinds = kinds[: stages - 1]
    # The bfloat16 and float16 leaves round the activations, but the reference
    # runs the same stage functions with the same casts, so the tolerance stays
    # float32's.
    result = testing.check_schedule(
        schedule,
        data=data,
        tick_layout=layout,
        scan_layers=scan_layers,
        activations=kinds,
        lowering=lowering,
    )
    assert result.passed, (
        schedule,
        layout,
        scan_layers,
        kinds,
        data,
        lowering,
        overlap,
        replicas,
        result,
    )


@pytest.mark.slow
@pytest.mark.parametrize("seed", [8, 15])
@pytest.mark.parametrize("lowering", jpipe.LOWERINGS)
def test_random_cells_are_exact(seed, lowering):
    # Not left to the draw: these seeds hold cells of an F with an I and with
    # a B issued as one program, and a cell split (its backward waits on its
    # forward), on 2 and 3 ranks with ranks holding several stages.
    from jpipe.lower.mpmd.programs import issue_ops

    ranks = 2 + seed % 2
    schedule = random_schedule(seed, ranks, ranks + 1 + seed % 2, 3, overlap=True)
    order, cells = issue_ops(schedule)
    written = sum(isinstance(c, jpipe.Overlap) for row in schedule.ranks for c in row)
    assert {order[i + 1][1].kind for i in cells} == {"I", "B"} and written > len(cells)
    # Packed ticks, where the SPMD program runs each cell whose halves share
    # a tick as one branch (`auto` lays these out unit, one piece a tick).
    result = testing.check_schedule(schedule, lowering=lowering, tick_layout="packed")
    assert result.passed, (schedule, result)


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(4))
def test_random_memory_actions_are_exact_in_one_spmd_program(seed):
    # Not left to the draw: each seed recomputes, evicts and offloads at
    # random, on 2 or 3 ranks with ranks holding several stages.
    ranks = 2 + seed % 2
    schedule = random_schedule(seed, ranks, ranks + 1 + seed % 2, 3, memory=True)
    kinds = {a.kind for _, _, a in schedule.all_actions() if a.is_memory}
    assert len(kinds) >= 4, kinds
    result = testing.check_schedule(schedule, data=2 if seed % 2 == 0 else 1)
    assert result.passed, (schedule, result)


@pytest.mark.slow
@pytest.mark.parametrize("lowering", ["spmd", "mpmd"])
def test_a_fuzz_case_whose_bfloat16_leaves_round_with_the_split(lowering):
    # Found by the fuzz (seed 309330191906104562397167946855215716685): the
    # reference on the whole batch rounds a bfloat16 leaf otherwise than on
    # the pipeline's microbatches (a float32 sum in another order); the
    # pipeline was off by 3.4e-4 from the whole batch under both lowerings,
    # and is within float32 of the same microbatches (`check_schedule`).
    schedule = random_schedule(0, 1, 3, 4)
    result = testing.check_schedule(
        schedule, data=2, tick_layout="unit", activations=("tuple", "dict"), lowering=lowering
    )
    assert result.passed, result


# Meshes of up to 8 devices beside a pipe axis of up to 2 ranks.
model_meshes = st.sampled_from(
    [{"tensor": 2}, {"fsdp": 2, "tensor": 2}, {"data": 2, "tensor": 2}, {"tensor": 4}, {"fsdp": 2}]
)


@pytest.mark.slow
@slow
@given(
    sizes.map(lambda t: (t[0], min(t[1], 2), max(min(t[1], 2), t[2]), t[3])),
    st.sampled_from(testing.TENSOR_BLOCKS),
    model_meshes,
    st.sampled_from(["unit", "packed"]),
)
def test_random_schedules_with_plain_collectives_are_exact(size, block, axes, layout):
    # Every stage runs a block that writes its own psum, pmean, psum_scatter
    # or all_gather over "tensor" (jpipe.testing.tensor_model), on meshes
    # with tensor, fsdp and data axes beside pipe.
    seed, ranks, stages, microbatches = size
    schedule = random_schedule(seed, ranks, stages, microbatches)
    jpipe.validate(schedule)
    result = testing.check_schedule(schedule, model=f"tensor:{block}", tick_layout=layout, **axes)
    assert result.passed, (schedule, block, axes, layout, result)


def test_small_model_refuses_unknown_activations():
    with pytest.raises(ValueError, match="one per boundary"):
        testing.small_model(3, activations=("dict",))
    with pytest.raises(ValueError, match="'list'"):
        testing.small_model(2, activations="list")


def corrupt(schedule: jpipe.Schedule, seed: int) -> jpipe.Schedule:
    rng = random.Random(seed)
    rows = [list(schedule.actions(r)) for r in range(schedule.num_ranks)]
    r = rng.choice([i for i, row in enumerate(rows) if row])
    row = rows[r]
    how = rng.choice(["drop", "duplicate", "swap"])
    i = rng.randrange(len(row))
    if how == "drop":
        del row[i]
    elif how == "duplicate":
        row.insert(rng.randrange(len(row) + 1), row[i])
    else:
        j = rng.randrange(len(row))
        row[i], row[j] = row[j], row[i]
    return jpipe.Schedule.of(rows, name=f"{schedule.name}-{how}")


@pytest.mark.slow
@slow
@given(sizes, st.integers(0, 2**31))
def test_corrupted_schedules_are_refused_or_exact(size, corruption_seed):
    seed, ranks, stages, microbatches = size
    schedule = corrupt(random_schedule(seed, ranks, stages, microbatches), corruption_seed)
    try:
        jpipe.validate(schedule)
    except jpipe.ScheduleError:
        with pytest.raises(jpipe.ScheduleError):
            testing.check_schedule(schedule)
        return
    result = testing.check_schedule(schedule)
    assert result.passed, (schedule, result)
