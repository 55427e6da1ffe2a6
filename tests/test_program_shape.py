"""What the compiled program is made of: its control, its copies of each stage, its buffers.

These read the compiled HLO of a training step (fake CPU devices, compiled
from shapes, nothing run) and the buffers the lowering sizes; exactness is
tested elsewhere (test_compiler.py).
"""

import json
import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import jpipe
from jpipe import testing
from jpipe.lower.spmd.program import switch_writes_in_place
from jpipe.lower.spmd.ticks import pack_lifetimes

ROW = jpipe.Program.ROW

ROOT = Path(__file__).resolve().parent.parent


def compiled_step(name, ranks, microbatches, chunks=1, rows=2, control="auto"):
    """The compiled training step of the checker's model, and its pipeline."""
    schedule = jpipe.get_schedule(name, ranks, microbatches, chunks if chunks > 1 else None)
    stages, params, make_batch = testing.small_model(schedule.num_stages)
    mesh = jpipe.make_mesh(ranks, 1, jax.devices()[:ranks])
    pipe = jpipe.Pipeline(stages, schedule, mesh, control=control)
    packed = pipe.packed_shapes(params)
    batch = jax.tree.map(
        lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=pipe.batch_sharding),
        make_batch(rows * microbatches),
    )
    return jax.jit(pipe.step_fn(batch)).lower(packed, batch).compile(), pipe, batch


SWITCH_IN_PLACE = switch_writes_in_place("cpu")


@pytest.mark.slow
@pytest.mark.parametrize("control", ["cond", "switch"])
@pytest.mark.parametrize(
    "name,chunks", [("1f1b", 1), ("zb_h1", 1), ("interleaved_1f1b", 2), ("zbv", 2)]
)
def test_a_step_has_few_conditionals_whatever_its_size(name, chunks, control):
    # "cond": F and I are a cond per stage class (each writes its residuals
    # or its carry in place); W a cond (runs one, or not) around a switch
    # over the classes; on ranks with several stages, W is a cond per class
    # instead (each adds to its own buckets only). "switch": one switch per kind.
    # Nothing else branches: no conditional per io write, per channel or per
    # stage.
    for ranks in (2, 4):
        compiled, pipe, batch = compiled_step(name, ranks, 8, chunks, control=control)
        hlo = compiled.as_text()
        classes = len(set(pipe.program(batch).classes))
        assert hlo.count(" while(") == 1
        if control == "switch":
            want = 3
        else:
            want = 2 * classes + 2 if chunks == 1 else 3 * classes
        assert hlo.count(" conditional(") == want, (name, ranks)
    # At 4 ranks some blocks share a branch, so classes are fewer than stages.
    assert classes < pipe.schedule.num_stages


@pytest.mark.slow
@pytest.mark.parametrize("control", ["cond", "switch"])
def test_an_overlap_cell_in_one_tick_is_one_branch(control, monkeypatch):
    # DualPipeV laid out packed: each Overlap cell's F and I share a tick, and
    # run in one branch of their own kind of cell (F then I), the F and I
    # conditionals idle there: one conditional more in all ("switch") or per
    # kind of cell ("cond"). Laid out unit, no cell shares a tick.
    from jpipe.lower.spmd.program import cell_classes, plan_cells

    schedule = jpipe.get_schedule("dualpipev", 2, 4, 2)
    written = sum(isinstance(c, jpipe.Overlap) for row in schedule.ranks for c in row)
    stages, params, make_batch = testing.small_model(schedule.num_stages)
    mesh = jpipe.make_mesh(2, 1, jax.devices()[:2])
    pipe = jpipe.Pipeline(stages, schedule, mesh, control=control, tick_layout="packed")
    batch = jax.tree.map(
        lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=pipe.batch_sharding),
        make_batch(8),
    )
    cells = plan_cells(pipe.tick_plan)
    assert len(cells) == written > 0
    assert plan_cells(jpipe.Pipeline(stages, schedule, mesh, tick_layout="unit").tick_plan) == {}
    packed = pipe.packed_shapes(params)
    program = pipe.program(batch)
    classes = len(set(program.classes))
    pairs = len(cell_classes(cells, program.classes))
    hlo = jax.jit(pipe.step_fn(batch)).lower(packed, batch).compile()
    want = 3 + 1 if control == "switch" else 3 * classes + pairs
    assert hlo.as_text().count(" conditional(") == want
    # The cells' branches copy no buffer: under the control this XLA keeps in
    # place, the step holds what it holds with each cell's halves apart
    # (measured 0.99x to 1.05x; a copy of the residual buffer made it 1.5x).
    import jpipe.lower.spmd.program as spmd_program

    if control == ("switch" if SWITCH_IN_PLACE else "cond"):
        monkeypatch.setattr(spmd_program, "plan_cells", lambda plan: {})
        apart = jpipe.Pipeline(stages, schedule, mesh, control=control, tick_layout="packed")
        apart_packed = apart.packed_shapes(params)
        apart = jax.jit(apart.step_fn(batch)).lower(apart_packed, batch).compile()
        monkeypatch.undo()
        temp = hlo.memory_analysis().temp_size_in_bytes
        assert temp <= 1.1 * apart.memory_analysis().temp_size_in_bytes
        fewer = 1 if control == "switch" else pairs
        assert apart.as_text().count(" conditional(") == want - fewer
    result = testing.check_schedule(schedule, tick_layout="packed", control=control)
    assert result.passed, result


@pytest.mark.slow
@pytest.mark.parametrize(
    "name,chunks", [("1f1b", 1), ("zb_h1", 1), ("interleaved_1f1b", 2), ("zbv", 2)]
)
def test_the_default_control_is_what_this_xla_keeps_in_place(name, chunks):
    # Where XLA updates a buffer in place through a switch (jaxlib 0.12's
    # XLA:CPU; 0.10.2's copies it), the default step has at most 3
    # conditionals; elsewhere it keeps the conds.
    # Microbatches of 64 rows: buffers large enough that a copy of one shows
    # beside the pieces' own working memory.
    compiled, pipe, batch = compiled_step(name, 4, 8, chunks, rows=64)
    program = pipe.program(batch)
    assert program.control == ("switch" if SWITCH_IN_PLACE else "cond")
    conditionals = compiled.as_text().count(" conditional(")
    if SWITCH_IN_PLACE:
        assert conditionals <= 3
    else:
        assert conditionals > 3
    # The probe's answer holds for the real program: the other control
    # needs more temp (the switch's copies, or the conds' widened carries).
    other_control = "cond" if SWITCH_IN_PLACE else "switch"
    other = compiled_step(name, 4, 8, chunks, rows=64, control=other_control)[0]
    temp = compiled.memory_analysis().temp_size_in_bytes
    assert temp < other.memory_analysis().temp_size_in_bytes


def test_the_probe_matches_what_each_jaxlib_was_measured_to_do():
    # bench.xla_limits, docs/compiler-measurements.md: jaxlib 0.10.2's
    # XLA:CPU copies a buffer written through a switch, 0.12.0's does not.
    version = tuple(int(p) for p in jax.__version__.split(".")[:2])
    if version <= (0, 10):
        assert not SWITCH_IN_PLACE
    if version >= (0, 12):
        assert SWITCH_IN_PLACE


@pytest.mark.slow
def test_stages_of_one_structure_share_one_branch():
    # The checker's model: an embedding stage, alike blocks, a head.
    _, pipe, batch = compiled_step("1f1b", 4, 4)
    program = pipe.program(batch)
    assert program.classes == (0, 1, 1, 2)
    _, pipe, batch = compiled_step("interleaved_1f1b", 2, 4, chunks=2)
    # Rank 0 holds stages 0 and 2, rank 1 stages 1 and 3: the two blocks read
    # different buckets, so they are not one class.
    assert pipe.program(batch).classes == (0, 1, 2, 3)


_COUNT_SCRIPT = textwrap.dedent(
    """
    import json, sys
    import jax
    jax.config.update("jax_num_cpu_devices", 16)
    sys.path.insert(0, {tests!r})
    from test_program_shape import compiled_step
    out = {{}}
    for ranks in (4, 16):
        hlo = compiled_step("1f1b", ranks, ranks, control="cond")[0].as_text()
        out[ranks] = {{"dots": hlo.count(" dot("), "conditionals": hlo.count(" conditional(")}}
    print(json.dumps(out))
    """
)


@pytest.mark.slow
def test_deeper_pipelines_do_not_grow_the_program():
    # 16 ranks of alike blocks compile to the same pieces as 4: the program
    # holds each distinct stage once (in a fresh process with 16 devices).
    env = dict(os.environ, PYTHONPATH=str(ROOT), XLA_FLAGS="")
    script = _COUNT_SCRIPT.format(tests=str(ROOT / "tests"))
    run = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600
    )
    assert run.returncode == 0, run.stderr[-3000:]
    counts = json.loads(run.stdout.strip().splitlines()[-1])
    four, sixteen = counts["4"], counts["16"]
    assert four["dots"] > 0
    assert sixteen["dots"] <= 1.5 * four["dots"], counts
    # Three classes (embedding, blocks, head): 2 * 3 + 2 (see the test above).
    assert sixteen["conditionals"] == four["conditionals"] == 8, counts


@pytest.mark.slow
def test_residual_buffer_is_the_largest_ranks_need():
    # One stage per rank: each rank keeps its peak of live residuals at its
    # own stage's size, and the buffer is the largest rank's (each F writes
    # its residuals inside its own branch, as wide as they are).
    _, pipe, batch = compiled_step("1f1b", 4, 8)
    program = pipe.program(batch)
    peaks = jpipe.simulate(pipe.schedule).peak_activations
    rows = program.arena_rows["res"]
    own = [value_rows(k.res_avals) for k in program.kernels]
    widest = max(own)
    need = max(peaks[r] * own[s] for r, s in enumerate(pipe.schedule.stage_to_rank))
    assert rows == need
    # The buffer of the slots before: the busiest rank's count, plus a
    # spare, times the widest stage.
    assert rows < (max(peaks) + 1) * widest


def value_rows(avals) -> int:
    """Rows of 32-bit words a value takes in the buffer, each leaf from a row of its own."""
    words = [-(-math.prod(a.shape) * np.dtype(a.dtype).itemsize // 4) for a in avals]
    return sum(-(-n // ROW) for n in words)


@pytest.mark.slow
def test_values_of_every_dtype_share_one_buffer():
    # Rank 0 keeps float32 residuals, rank 1 bfloat16 ones: one buffer of
    # words holds both, as large as the larger rank's values of every dtype
    # together, not the sum over dtypes of each dtype's largest rank. The
    # step stays exact (the values go through raw words and back).
    width, rows = 64, 8

    def first(p, x, inputs):
        return jnp.tanh(jnp.tanh(inputs["x"] @ p["w"]) @ p["v"])

    def last(p, x, inputs):
        h = jnp.tanh(x.astype(jnp.bfloat16) @ p["w"].astype(jnp.bfloat16))
        h = jnp.tanh(h @ p["v"].astype(jnp.bfloat16))
        return jnp.mean((h.astype(jnp.float32) - inputs["y"]) ** 2)

    keys = iter(jax.random.split(jax.random.key(0), 8))
    params = [
        {n: jax.random.normal(next(keys), (width, width)) / 8 for n in "wv"} for _ in range(2)
    ]
    M = 4
    batch = {k: jax.random.normal(next(keys), (rows * M, width)) for k in "xy"}
    schedule = jpipe.get_schedule("1f1b", 2, M)
    pipe = jpipe.Pipeline([first, last], schedule, jpipe.make_mesh(2, 1, jax.devices()[:2]))
    packed = pipe.pack(params)
    loss, grads = pipe.value_and_grad(packed, batch)
    want = jpipe.reference_value_and_grad([first, last], params, batch, M)
    _, rel = testing.compare((loss, pipe.unpack(grads)), want)
    assert rel < 1e-5, rel

    program = pipe.program(batch)
    kernels = program.kernels
    assert {str(a.dtype) for a in kernels[0].res_avals} == {"float32"}
    assert "bfloat16" in {str(a.dtype) for a in kernels[1].res_avals}
    peaks = jpipe.simulate(schedule).peak_activations  # 2 on rank 0, 1 on rank 1
    own = [value_rows(k.res_avals) for k in kernels]
    assert program.arena_rows["res"] == max(peaks[s] * own[s] for s in range(2))
    per_dtype = {
        dt: max(
            peaks[s] * value_rows([a for a in k.res_avals if str(a.dtype) == dt])
            for s, k in enumerate(kernels)
        )
        for dt in ("float32", "bfloat16")
    }
    assert program.arena_rows["res"] < sum(per_dtype.values())


intervals = st.lists(
    st.tuples(st.integers(0, 30), st.integers(0, 10), st.integers(0, 5)), max_size=25
)


@pytest.mark.slow
@settings(max_examples=200, deadline=None)
@given(intervals)
def test_packed_values_never_overlap_while_both_live(ivs):
    lifetimes = [(start, start + length, i) for i, (start, length, _) in enumerate(ivs)]
    size = {i: s for i, (_, _, s) in enumerate(ivs)}
    extent, offset = pack_lifetimes(lifetimes, size.__getitem__)
    for a, (sa, ea, _) in enumerate(lifetimes):
        assert offset[a] + size[a] <= extent
        for b, (sb, eb, _) in enumerate(lifetimes[:a]):
            if sa <= eb and sb <= ea and size[a] and size[b]:  # live together
                assert offset[a] + size[a] <= offset[b] or offset[b] + size[b] <= offset[a]
    # No placement needs less than the peak of live sizes.
    peak = max(
        (sum(size[i] for i, (s, e, _) in enumerate(lifetimes) if s <= t <= e) for t in range(41)),
        default=0,
    )
    assert extent >= peak
    if len(set(size.values())) == 1:  # one size: the colouring, which is optimal
        assert extent == peak


@pytest.mark.slow
def test_show_reports_the_programs_transfers(capsys):
    from jpipe import show

    assert show.main(["1f1b", "--ranks", "4", "--microbatches", "8", "--json"]) == 0
    program = json.loads(capsys.readouterr().out)["program"]
    plan = jpipe.make_tick_plan(jpipe.get_schedule("1f1b", 4, 8))
    assert program["sent"] == 2 * 3 * 8  # every boundary, forward and back, each microbatch
    assert program["collectives"] == plan.num_ticks * len(plan.channels)
    assert 0 < program["exposed"] <= program["sent"]
    assert 0 < program["idle"] < program["collectives"]
