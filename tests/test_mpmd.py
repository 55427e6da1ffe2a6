"""The per-rank lowering (``lowering="mpmd"``): its op list, programs, refusals and trainer.

Its exactness against the unpipelined model is tested with the SPMD
lowering's, by the same tests parametrized over `jpipe.LOWERINGS`
(test_compiler, test_sharded, test_weighted_loss, test_dropout,
test_scan_split, the fuzz in test_compiler_properties).
"""

import gc
import re

import jax
import numpy as np
import pytest

import jpipe
from jpipe import models, testing
from jpipe.lower.mpmd.programs import RankPrograms, issue_ops, issue_order
from jpipe.models import gpt

RTOL = 1e-5
CONFIG = gpt.GPTConfig(vocab_size=64, num_layers=4, d_model=32, num_heads=2, seq_len=8, d_ff=64)


def _pipeline(
    name="1f1b", ranks=2, microbatches=4, chunks=None, data=1, lowering="mpmd", **options
):
    schedule = jpipe.get_schedule(name, ranks, microbatches, chunks, **options)
    model = models.make_stages(CONFIG, models.split_layers(CONFIG.num_layers, schedule.num_stages))
    params = model.init(0)
    pipe = jpipe.Pipeline(model.stages, schedule, jpipe.make_mesh(ranks, data), lowering=lowering)
    batch = jax.device_put(
        models.example_batch(CONFIG, batch_size=8 * data, seed=1), pipe.batch_sharding
    )
    return pipe, model, params, batch


@pytest.mark.parametrize(
    "name,ranks,microbatches,chunks",
    [("1f1b", 4, 8, None), ("zb_h1", 4, 8, None), ("interleaved_1f1b", 2, 4, 2), ("zbv", 2, 4, 2)],
)
def test_the_op_list_keeps_each_ranks_order_and_puts_inputs_first(
    name, ranks, microbatches, chunks
):
    schedule = jpipe.get_schedule(name, ranks, microbatches, chunks)
    order = issue_order(schedule)
    for r in range(ranks):
        mine = [a for rank, a in order if rank == r]
        assert mine == [a for step in schedule.actions(r) for a in step.parts]
    issued = set()
    S = schedule.num_stages
    for _, a in order:
        s, m = a.stage, a.microbatch
        if a.kind == "F" and s > 0:
            assert ("F", s - 1, m) in issued
        if a.kind in "IB" and s < S - 1:
            assert ("I", s + 1, m) in issued
        if a.kind == "W":
            assert ("I", s, m) in issued
        issued.add((a.kind, s, m))
        if a.kind == "B":
            issued.add(("I", s, m))


def test_a_schedule_that_waits_forever_is_refused_by_name():
    # Rank 1 runs the backward of microbatch 0 before the forward that feeds
    # it can come; the op list names what each rank waits on.
    bad = jpipe.Schedule.of([["0F0", "0B0"], ["1B0", "1F0"]])
    with pytest.raises(ValueError, match=r"every rank waits \(rank 0: 0B0, rank 1: 1B0\)"):
        issue_order(bad)


def test_each_dualpipev_cell_is_one_op_unless_its_backward_waits_on_its_forward():
    # DualPipeV's cells: every one issued whole, its two halves side by side.
    for ranks, microbatches in [(2, 4), (4, 10), (8, 16)]:
        schedule = jpipe.get_schedule("dualpipev", ranks, microbatches, 2)
        order, cells = issue_ops(schedule)
        written = [
            (r, step.parts)
            for r in range(ranks)
            for step in schedule.ranks[r]
            if isinstance(step, jpipe.Overlap)
        ]
        assert sorted((order[i][0], (order[i][1], order[i + 1][1])) for i in cells) == sorted(
            written
        )
        assert all(order[i][0] == order[i + 1][0] for i in cells)
        assert order == issue_order(schedule)
        assert issue_ops(schedule, fuse_cells=False).cells == frozenset()
    # Rank 0's cell pairs F(0,1) with B(0,1), which needs rank 1's I(1,1),
    # which needs F(0,1)'s output: one program would wait on itself, so the
    # cell is issued as its halves, the forward first.
    F, B = jpipe.F, jpipe.B
    waits = jpipe.Schedule.of(
        [[F(0, 0), jpipe.Overlap(F(0, 1), B(0, 1)), B(0, 0)], [F(1, 0), F(1, 1), B(1, 1), B(1, 0)]]
    )
    jpipe.validate(waits)
    order, cells = issue_ops(waits)
    assert cells == frozenset()
    assert [a for r, a in order if r == 0] == [F(0, 0), F(0, 1), B(0, 1), B(0, 0)]
    # The same cell on rank 1, F(1,1) with B(1,0), needs nothing of its own: one op.
    fine = jpipe.Schedule.of(
        [[F(0, 0), F(0, 1), B(0, 0), B(0, 1)], [F(1, 0), jpipe.Overlap(F(1, 1), B(1, 0)), B(1, 1)]]
    )
    order, cells = issue_ops(fine)
    assert [(order[i], order[i + 1]) for i in cells] == [((1, F(1, 1)), (1, B(1, 0)))]
    # Two cells waiting at once: rank 1's waits on itself (B(1,1) needs F(1,1)),
    # rank 0's only on rank 1. The split goes to the cell that waited on
    # itself, and rank 0's stays one program.
    both = jpipe.Schedule.of(
        [
            [F(0, 0), F(0, 1), jpipe.Overlap(F(0, 2), B(0, 0)), B(0, 1), B(0, 2)],
            [F(1, 0), jpipe.Overlap(F(1, 1), B(1, 1)), B(1, 0), F(1, 2), B(1, 2)],
        ]
    )
    jpipe.validate(both)
    order, cells = issue_ops(both)
    assert [(order[i], order[i + 1]) for i in cells] == [((0, F(0, 2)), (0, B(0, 0)))]


@pytest.mark.slow
def test_a_cell_is_one_program_with_the_cells_halves_results():
    # DualPipeV on 2 ranks: each Overlap cell runs as one program (its F and
    # its I, or its I and W), so a step issues one program fewer per cell,
    # and the step gives what the halves issued apart give.
    pipe, _, params, batch = _pipeline("dualpipev", ranks=2, microbatches=4, chunks=2)
    packed = pipe.pack(params)
    p = pipe
    args = (p.schedule, p.layout, p.mesh, p._kernels(batch), p.pipe_axis, p.data_axis)
    kwargs = dict(stage_to_rank=p.stage_to_rank, meshes=p.rank_meshes)
    fused = RankPrograms(*args, **kwargs)
    apart = RankPrograms(*args, **kwargs, fuse_cells=False)
    n_cells = sum(isinstance(c, jpipe.Overlap) for row in p.schedule.ranks for c in row)
    assert len(fused.cells) == n_cells > 0 and not apart.cells
    loss, grads = fused.run(packed, batch)
    want_loss, want_grads = apart.run(packed, batch)
    # One host op fewer per cell (a B in a cell is its I and W: two fewer).
    in_b_cells = sum(fused.order[i + 1][1].kind == "B" for i in fused.cells)
    assert apart.last_run["host_ops"] - fused.last_run["host_ops"] == n_cells + in_b_cells
    # Each kind of cell compiled once, as one executable with both halves' outputs.
    assert set(fused.compiled_cells) == {fused._cell_key(i) for i in fused.cells}
    assert not apart.compiled_cells
    for (r, sf, sb, kind), exe in fused.compiled_cells.items():
        outs = jax.tree.leaves(exe.out_info)
        f_outs = jax.tree.leaves(fused.compiled[sf, r]["F"].out_info)
        b_outs = jax.tree.leaves(fused.compiled[sb, r]["I"].out_info)
        if kind == "B":  # dx and the accumulators, the carry kept inside
            b_outs = b_outs[: len(b_outs) - len(fused.kernels[sb].carry_avals)]
            b_outs += jax.tree.leaves(fused.compiled[sb, r]["W"].out_info)
        assert [(o.shape, o.dtype) for o in outs] == [(o.shape, o.dtype) for o in f_outs + b_outs]
    np.testing.assert_allclose(float(loss), float(want_loss), rtol=RTOL)
    for b in grads:
        np.testing.assert_allclose(grads[b], want_grads[b], rtol=RTOL, atol=1e-7)
    # The account charges each cell's own program at its forward half, nothing
    # at its backward half, and the halves' pieces nowhere.
    for i in fused.cells:
        m = fused.compiled_cells[fused._cell_key(i)].memory_analysis()
        own = m.temp_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes
        assert fused.op_working_bytes(i) == own > 0
        assert fused.op_working_bytes(i + 1) == 0
    # Rank 0's peak falls: a B's I-to-W carry stays inside its cell.
    assert fused.account()[0].peak_bytes < apart.account()[0].peak_bytes


@pytest.mark.slow
@pytest.mark.parametrize("name,chunks", [("1f1b", None), ("zb_h1", None), ("zbv", 2)])
def test_no_piece_holds_a_conditional(name, chunks):
    pipe, _, params, batch = _pipeline(name, chunks=chunks)
    packed = pipe.pack(params)
    compiled = pipe.compile(packed, batch).compiled
    texts = [c.as_text() for pieces in compiled.values() for c in pieces.values()]
    assert len(texts) == pipe.schedule.num_stages * len(compiled[0, 0])
    assert all(re.search(r"\bconditional\(", t) is None for t in texts)
    # The SPMD program of the same schedule has them (the test can fail).
    spmd = jpipe.Pipeline(pipe.stages, pipe.schedule, pipe.mesh)
    text = spmd.compile(spmd.pack(params), batch).as_text()
    assert re.search(r"\bconditional\(", text) is not None


@pytest.mark.slow
def test_forward_only_loss_and_repeated_steps():
    pipe, model, params, batch = _pipeline("interleaved_1f1b", chunks=2, data=2)
    packed = pipe.pack(params)
    ref_loss, ref_grads = jpipe.reference_value_and_grad(model.stages, params, batch)
    for _ in range(2):  # the second step reuses every program and buffer
        loss, grads = pipe.value_and_grad(packed, batch)
        _, rel = testing.compare((loss, pipe.unpack(grads)), (ref_loss, ref_grads))
        assert rel <= RTOL
    np.testing.assert_allclose(float(pipe.loss(packed, batch)), float(ref_loss), rtol=RTOL)
    # The loss and gradients are laid out as the SPMD lowering's.
    assert loss.sharding == jax.sharding.NamedSharding(pipe.mesh, jax.P())
    assert {b: g.sharding for b, g in grads.items()} == pipe.param_sharding
    ops = pipe.rank_programs(batch).last_run["host_ops"]
    # One op per piece, one per transfer, plus the step's set-up and finish.
    pieces = sum(len(pipe.schedule.actions(r)) for r in range(2))
    assert pieces <= ops <= 3 * pieces


@pytest.mark.slow
def test_what_only_the_spmd_lowering_does_is_refused_naming_the_lowering():
    pipe, _, params, batch = _pipeline()
    packed = pipe.pack(params)
    for call in (
        lambda: pipe.step_fn(batch),
        lambda: pipe.lower(packed, batch),
        lambda: pipe.program(batch),
    ):
        with pytest.raises(ValueError, match=r"lowering='mpmd'.*lowering='spmd'"):
            call()
    with pytest.raises(ValueError, match=r"cannot be traced: it cannot sit inside jax.jit"):
        jax.jit(pipe.value_and_grad)(packed, batch)
    with pytest.raises(ValueError, match=r"cannot be traced"):
        jax.grad(lambda p: pipe.value_and_grad(p, batch)[0])(packed)
    with pytest.raises(ValueError, match=r"lowering must be one of 'spmd', 'mpmd'; got 'per-rank'"):
        jpipe.Pipeline(pipe.stages, pipe.schedule, pipe.mesh, lowering="per-rank")
    with pytest.raises(ValueError, match="all_idle"):
        jpipe.Pipeline(pipe.stages, pipe.schedule, pipe.mesh, lowering="mpmd", all_idle=True)


def test_a_stage_reading_its_pipe_index_is_refused():
    # Under the per-rank lowering a rank's sub-mesh has one device on pipe,
    # so axis_index("pipe") would be 0 everywhere: refused, not wrong.
    def stage(params, x, inputs):
        x = inputs["x"] if x is None else x
        return x * params["w"] + jax.lax.axis_index("pipe").astype(x.dtype)

    def last(params, x, inputs):
        return jax.numpy.mean((x * params["w"]) ** 2)

    schedule = jpipe.get_schedule("1f1b", 2, 2)
    pipe = jpipe.Pipeline([stage, last], schedule, jpipe.make_mesh(2), lowering="mpmd")
    params = [{"w": np.ones((3,), np.float32)}] * 2
    packed = pipe.pack(params)
    with pytest.raises(ValueError, match=r"stage 0 reads lax.axis_index\('pipe'\)"):
        pipe.value_and_grad(packed, {"x": np.ones((4, 3), np.float32)})


@pytest.mark.slow
def test_the_trainer_runs_the_per_rank_lowering_to_the_spmd_losses(tmp_path):
    from test_train import tiny_config

    from jpipe import train as trainer

    def run(lowering, dropout, schedule="1f1b"):
        overrides = {"lowering": lowering, "schedule": schedule, "model.dropout": dropout}
        # test_train.py's dropout run (4 steps, held out at the end): the SPMD
        # step is compiled once for both files (the suite's compilation cache).
        config = tiny_config(steps=4, eval_every=0, **overrides)
        path = tmp_path / f"{lowering}{dropout}{schedule}"
        return trainer.train(config, str(path), progress=False)

    # With dropout (the masks drawn from each row's key, as the trainer draws
    # them), and a recompute must draw the forward's own masks: the losses
    # after three updates say whether the gradients were right.
    spmd = run("spmd", 0.1)
    for other in (run("mpmd", 0.1), run("mpmd", 0.1, "1f1b_recompute")):
        assert sorted(other.losses) == [1, 2, 3, 4]
        np.testing.assert_allclose(
            [other.losses[s] for s in (1, 2, 3, 4)],
            [spmd.losses[s] for s in (1, 2, 3, 4)],
            rtol=RTOL,
        )
        np.testing.assert_allclose(other.eval_losses[4], spmd.eval_losses[4], rtol=RTOL)


def _bytes_on(devices) -> dict:
    """Bytes of live device buffers per device, each buffer once (views share one).

    Arrays in host memory (an offload's copies) are not the device's.
    """
    seen, out = set(), dict.fromkeys(devices, 0)
    for a in jax.live_arrays():
        if a.sharding.memory_kind not in (None, "device"):
            continue
        for shard in a.addressable_shards:
            key = (shard.device, shard.data.unsafe_buffer_pointer())
            if shard.device in out and key not in seen:
                seen.add(key)
                out[shard.device] += shard.data.nbytes
    return out


def measure_each_op(pipe, params, batch):
    """``(programs, measured)``: a step of the per-rank programs run again once compiled,
    and after each op each rank's devices' bytes beyond what they held before it."""
    packed = pipe.pack(params)
    programs = pipe.rank_programs(batch)
    programs.run(packed, batch)  # compiles; its outputs are dropped
    devices = [list(m.devices.flat) for m in programs.meshes]
    # Garbage of earlier tests in this worker (reference cycles holding arrays)
    # must not be collected mid-step, where it would read as a rank's values.
    gc.collect()
    gc.disable()
    before = _bytes_on([d for ds in devices for d in ds])
    measured = []

    def after(i):
        for a in jax.live_arrays():
            a.block_until_ready()
        now = _bytes_on(before)
        measured.append([[now[d] - before[d] for d in ds] for ds in devices])

    try:
        programs.run(packed, batch, after_op=after)
    finally:
        gc.enable()
    return programs, measured


@pytest.mark.slow
@pytest.mark.parametrize(
    "name,ranks,chunks,data,options",
    [
        ("1f1b", 2, None, 1, {}),
        ("zb_h1", 2, None, 1, {}),
        ("zb_h1", 2, None, 2, {}),
        ("zbv", 2, 2, 1, {}),
        ("dualpipev", 2, 2, 1, {}),  # Overlap cells, each one program
        # Memory actions: FC and RECOMPUTE, EVICT to a partner and LOAD, the offloads.
        ("1f1b_recompute", 2, None, 1, {"k": 1}),
        ("1f1b_bpipe", 4, None, 1, {}),
        ("zb_h1_offload", 2, None, 2, {}),
    ],
)
def test_the_accounted_values_are_the_live_arrays(name, ranks, chunks, data, options):
    # After every op of a real step, each device holds exactly its rank's
    # accounted values (`held_values`) and, once made, gradient accumulators beyond what
    # it held before the step (parameters, batch, the programs' constants).
    pipe, _, params, batch = _pipeline(
        name, ranks=ranks, microbatches=2 * ranks, chunks=chunks, data=data, **options
    )
    memory = name in ("1f1b_recompute", "1f1b_bpipe", "zb_h1_offload")
    assert pipe.schedule.has_memory_actions == memory
    programs, measured = measure_each_op(pipe, params, batch)
    held, accounts, made = programs.held_values(), programs.account(), programs.accumulators_made()
    assert len(measured) == len(programs.order)
    assert bool(programs.cells) == (name == "dualpipev")
    for i, per_rank in enumerate(measured):
        if i in programs.cells:  # a cell's halves run as one program: nothing between them
            continue
        for r, per_device in enumerate(per_rank):
            # The rank's gradient accumulators, from just before its first W or B.
            want = held[i][r] + (accounts[r].grad_bytes if i >= made[r] else 0)
            assert per_device == [want] * len(per_device), (i, programs.order[i], r)
    values = [a.values_bytes for a in accounts]
    assert values == [max(h[r] for h in held) for r in range(len(values))]
    # Not a constant: what each rank holds rises and falls as its list runs.
    assert all(len({h[r] for h in held}) > 2 for r in range(len(values)))
