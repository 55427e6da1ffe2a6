"""Replicated stages run: a stage on several ranks, under both lowerings.

Chimera's and DualPipe's two pipelines each hold a copy of the model. Each
microbatch runs on the rank that runs its forward, and the copies' gradient
sums are added at the step's end, so every copy's gradient is the same and
equals the unpipelined model's. The per-rank lowering jits a stage's pieces
on every rank that holds it and sends each copy's sums to the stage's first
rank and the total back; the SPMD program lays each (stage, microbatch) out
on its own rank in the tick plan (a channel per direction) and adds the
copies with one masked psum over ``pipe`` per stage. The language,
validator and simulator side is tested in test_validate.
"""

import jax
import numpy as np
import pytest
from test_validate import _users_chimera  # Chimera as a user writes it (issue 39)

import jpipe
from jpipe import testing
from jpipe.stage.pack import ParamLayout


def test_a_replicated_stages_copies_share_bucket_names_and_rows():
    # Stage 0 on ranks 0 and 1, stage 1 on rank 1 only: the copies of stage
    # 0's array share one bucket, and stage 1's same-sized array takes the
    # next.
    params = [{"w": np.arange(4.0, dtype=np.float32)}, {"v": np.ones(4, np.float32)}]
    layout = ParamLayout.of(params, (0, 1), 2, stage_ranks=((0, 1), (1,)))
    (name0,) = layout.stage_buckets(0)
    (name1,) = layout.stage_buckets(1)
    assert name0 != name1
    assert layout.rank_buckets(0) == (name0,) and layout.rank_buckets(1) == (name0, name1)
    host = layout.pack_host(params)
    np.testing.assert_array_equal(host[name0][0], host[name0][1])  # a copy on each rank
    np.testing.assert_array_equal(host[name1][1], params[1]["v"])
    assert not host[name1][0].any()  # padding
    assert layout.padding["used"] == 3 * 4  # the copy counts as used
    assert layout.padding["model"] == 2 * 4  # the model's own: each stage once
    back = layout.unpack_host(host)
    np.testing.assert_array_equal(back[0]["w"], params[0]["w"])
    # Without stage_ranks, one rank per stage as before.
    assert ParamLayout.of(params, (0, 1), 2).stage_ranks == ((0,), (1,))


@pytest.mark.parametrize("lowering", jpipe.LOWERINGS)
@pytest.mark.parametrize(
    "schedule",
    [_users_chimera(), jpipe.get_schedule("chimera", 4, 8)],
    ids=["as-a-user-writes-it", "built-in"],
)
def test_chimera_is_exact(schedule, lowering):
    assert schedule.replicated
    result = testing.check_schedule(schedule, lowering=lowering)
    # passed: loss and gradients within float32's tolerance of the unpipelined
    # model's, and every copy's gradients the same to the bit.
    assert result.passed, result
    assert result.lowering == lowering


def test_the_spmd_tick_plan_sends_each_microbatch_to_its_own_rank_both_ways():
    # Chimera's down pipeline sends rank r to r + 1, its up pipeline r to r - 1:
    # forwards and input gradients each go both ways, so the program has a
    # collective for each shift (1 and R - 1), where 1F1B has the same two.
    plan = jpipe.make_tick_plan(jpipe.get_schedule("chimera", 4, 8), "unit")
    assert sorted(shift for _, shift in plan.channels) == [1, 3]
    for _, r, (_, s, m) in plan.pieces():
        assert plan.key_rank[s * 8 + m] == r  # each piece on the rank of its microbatch
    one = jpipe.make_tick_plan(jpipe.get_schedule("1f1b", 4, 8), "unit")
    assert plan.key_rank[8:16] == (1, 2) * 4 and one.key_rank[8:16] == (1,) * 8


def test_every_copy_steps_alike_and_the_account_holds_each_ranks_copies():
    schedule = jpipe.get_schedule("chimera", 4, 8)
    stages, params, make_batch = testing.small_model(4)
    pipe = jpipe.Pipeline(stages, schedule, jpipe.make_mesh(4, 1), lowering="mpmd")
    packed = pipe.pack(params)
    batch = jax.device_put(make_batch(8), pipe.batch_sharding)
    loss, grads = pipe.value_and_grad(packed, batch)
    layout = pipe.layout
    # An SGD step on the packed arrays leaves the copies equal.
    stepped = jax.tree.map(lambda p, g: p - 0.1 * g, packed, grads)
    for s, ranks in enumerate(schedule.stage_ranks):
        for b in layout.stage_buckets(s):
            rows = np.asarray(stepped[b])
            for r in ranks[1:]:
                np.testing.assert_array_equal(rows[ranks[0]], rows[r])
    # Each rank accumulates gradients for both stages it holds; the first
    # copy's rank holds a copy's sums and their total at the step's end too.
    programs = pipe.compile(packed, batch)
    account = programs.account()

    def nbytes(s):
        return sum(
            int(np.prod(layout.buckets[b][0])) * np.dtype(layout.buckets[b][1]).itemsize
            for b in layout.stage_buckets(s)
        )

    for r in range(4):
        assert account[r].grad_bytes == sum(nbytes(s) for s in schedule.stages_of(r))
    for s, (first, *_) in enumerate(schedule.stage_ranks):
        assert account[first].peak_bytes >= account[first].grad_bytes + 2 * nbytes(s)
    # The copies' sums are the issue's only new transfers: losses agree with
    # a run of the same step again (nothing left over from the first).
    again, grads_again = pipe.value_and_grad(packed, batch)
    assert float(again) == float(loss)
    for b in grads:
        np.testing.assert_array_equal(np.asarray(grads[b]), np.asarray(grads_again[b]))


@pytest.mark.slow
@pytest.mark.parametrize("lowering", jpipe.LOWERINGS)
@pytest.mark.parametrize(
    "spec,ranks,microbatches,data",
    [("dualpipe", 4, 8, 1), ("chimera", 4, 8, 2)],
)
def test_the_replicated_built_ins_are_exact(spec, ranks, microbatches, data, lowering):
    # `python -m jpipe.check SPEC -r R -m 8 [--data 2] --lowering L` (issue 39).
    schedule = jpipe.get_schedule(spec, ranks, microbatches)
    result = testing.check_schedule(schedule, data=data, lowering=lowering, scan_layers=True)
    assert result.passed, result


@pytest.mark.slow
@pytest.mark.parametrize("lowering", jpipe.LOWERINGS)
@pytest.mark.parametrize("seed", [3, 11])
def test_random_replicated_placements_with_memory_actions_and_cells_are_exact(seed, lowering):
    from test_compiler_properties import random_schedule

    schedule = random_schedule(seed, 3, 4, 4, memory=True, overlap=True, replicas=True)
    assert schedule.replicated, "pick a seed that replicates a stage"
    result = testing.check_schedule(schedule, lowering=lowering)
    assert result.passed, (schedule, result)
