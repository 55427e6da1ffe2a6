"""The compiler against the unpipelined model: loss and every gradient.

Every run builds a real SPMD program on fake CPU devices (see conftest.py) and
compares it with `jax.value_and_grad` of the same model without a pipeline.
"""

from pathlib import Path

import jax
import numpy as np
import pytest

import jpipe
from jpipe import Pipeline, StageKernels, make_mesh, testing

RTOL = 1e-5  # float32; see jpipe.testing.CheckResult for how it is measured

PYTORCH = Path(__file__).resolve().parent / "data" / "pytorch-schedules"

# (schedule, ranks, microbatches, chunks): fewer microbatches than ranks
# (2, 1) and (4, 3), not divisible by the ranks (4, 3), and divisible (4, 6).
# (Random schedules of every shape: tests/test_compiler_properties.py.)
ONE_STAGE_PER_RANK = ["gpipe", "1f1b", "eager_1f1b", "zb_h1", "zb_h2"]
CASES = [(name, r, m, 1) for name in ONE_STAGE_PER_RANK for r, m in [(2, 1), (4, 3), (4, 6)]]
CASES += [
    (name, r, m, 2) for name in ["interleaved_1f1b", "looped_bfs"] for r, m in [(2, 3), (4, 6)]
]
CASES += [("interleaved_1f1b", 2, 4, 3)]
CASES += [("zbv", r, m, 2) for r, m in [(2, 1), (2, 3), (4, 6)]]
CASES += [("zbv:max_deferred_w=0", 4, 8, 2)]  # every W right after its I
CASES += [("dualpipev", r, m, 2) for r, m in [(2, 4), (2, 5), (4, 8)]]
CASES += [(name, r, m, 2) for name in ["vhalf", "vmin"] for r, m in [(2, 1), (2, 3), (4, 6)]]


# The fast tier (`pytest -m "not slow"`) keeps one plain and one split-backward
# case under each lowering; the rest run in the full suite.
FAST_CASES = [("1f1b", 4, 3, 1), ("zb_h1", 4, 3, 1)]


@pytest.mark.parametrize("lowering", jpipe.LOWERINGS)
@pytest.mark.parametrize(
    "name,ranks,microbatches,chunks",
    [case if case in FAST_CASES else pytest.param(*case, marks=pytest.mark.slow) for case in CASES],
)
def test_builtin_matches_unpipelined(name, ranks, microbatches, chunks, lowering):
    result = testing.check_schedule(name, ranks, microbatches, chunks, lowering=lowering)
    assert result.passed, result
    assert result.max_rel_err <= RTOL


OTHER_LAYOUT_CASES = [
    (name, r, m, chunks)
    for name, chunks in [(n, 1) for n in ONE_STAGE_PER_RANK]
    + [("interleaved_1f1b", 2), ("looped_bfs", 2), ("zbv", 2), ("dualpipev", 2)]
    + [("vhalf", 2), ("vmin", 2)]
    for r, m in [(4, 8)]
]


@pytest.mark.slow
@pytest.mark.parametrize("name,ranks,microbatches,chunks", OTHER_LAYOUT_CASES)
def test_builtin_in_the_layout_auto_does_not_take(name, ranks, microbatches, chunks):
    # The cases above run the layout "auto" picks; this runs the other one.
    auto = jpipe.make_tick_plan(jpipe.get_schedule(name, ranks, microbatches, chunks)).layout
    other = {"unit": "packed", "packed": "unit"}[auto]
    result = testing.check_schedule(name, ranks, microbatches, chunks, tick_layout=other)
    assert result.tick_layout == other
    assert result.passed, result


@pytest.mark.slow
@pytest.mark.parametrize(
    "name,microbatches,chunks",
    [
        ("gpipe", 4, 1),
        ("1f1b", 3, 1),
        ("interleaved_1f1b", 4, 2),
        ("zb_h1", 4, 1),
        ("zbv", 4, 2),
        ("dualpipev", 4, 2),
        ("eager_1f1b", 2, 1),
        ("zb_h2", 5, 1),
        ("looped_bfs", 2, 2),
        ("vhalf", 5, 2),
        ("vmin", 3, 2),
    ],
)
@pytest.mark.parametrize("lowering", jpipe.LOWERINGS)
def test_pipe_by_data_mesh(name, microbatches, chunks, lowering):
    result = testing.check_schedule(name, 2, microbatches, chunks, data=2, lowering=lowering)
    assert result.passed, result


@pytest.mark.slow
def test_bfloat16_compute_matches_the_same_policy_unpipelined():
    name, chunks = "zb_h1", None
    # float32 parameters, bfloat16 compute and activations, float32 loss: the
    # pipeline equals the same policy unpipelined on the same microbatches
    # to float32 precision (exactly, measured on CPU).
    result = testing.check_schedule(name, 2, 4, chunks, compute_dtype="bfloat16")
    assert result.passed, result
    # The bfloat16 noise the tolerance sits far below: the same policy on
    # the whole batch at once differs from it by more than 1e-3.
    stages, params, make_batch = testing.small_model(result.stages, compute_dtype="bfloat16")
    batch = make_batch(8, 1)  # as check_schedule's: 4 microbatches of 2 rows, seed 0 + 1
    split = jpipe.reference_value_and_grad(stages, params, batch, 4)
    whole = jpipe.reference_value_and_grad(stages, params, batch, 1)
    assert float(split[0]) == result.reference_loss
    assert testing.compare(split, whole)[1] > 100 * result.rtol


@pytest.mark.slow
@pytest.mark.parametrize("filename", ["zb1p_2rank_2stagep_compute.csv", "dualpipev_4rank_10mb.csv"])
def test_pytorch_schedule_files(filename):
    path = PYTORCH / filename
    result = testing.check_schedule(str(path))
    assert result.passed, result


@pytest.mark.slow
def test_first_and_last_stage_on_one_rank():
    # Stage 0 and stage 3 on rank 0, stages 1 and 2 on rank 1; I/W split on some.
    F, B, I, W = jpipe.F, jpipe.B, jpipe.I, jpipe.W
    rank0, rank1 = [], []
    for m in range(3):
        rank0 += [F(0, m)]
        rank1 += [F(1, m), F(2, m)]
        rank0 += [F(3, m), I(3, m), W(3, m)]
        rank1 += [B(2, m), I(1, m), W(1, m)]
        rank0 += [B(0, m)]
    schedule = jpipe.Schedule.of([rank0, rank1], name="wrap")
    result = testing.check_schedule(schedule)
    assert result.passed, result


@pytest.mark.slow
def test_everything_on_one_rank():
    schedule = jpipe.get_schedule("1f1b", 1, 3)
    assert testing.check_schedule(schedule).passed


def _pipeline(schedule, data=1):
    stages, params, make_batch = testing.small_model(schedule.num_stages)
    mesh = make_mesh(schedule.num_ranks, data)
    return Pipeline(stages, schedule, mesh), params, make_batch


def test_refuses_a_schedule_that_does_not_fit_the_mesh():
    schedule = jpipe.get_schedule("1f1b", 4, 4)
    stages, _, _ = testing.small_model(4)
    with pytest.raises(
        ValueError, match="the schedule has 4 ranks but the mesh's 'pipe' axis has 2"
    ):
        Pipeline(stages, schedule, make_mesh(2, 1))


def test_refuses_a_schedule_that_does_not_fit_the_model():
    schedule = jpipe.get_schedule("1f1b", 2, 4)
    stages, _, _ = testing.small_model(3)
    with pytest.raises(
        ValueError, match="the schedule has 2 stages but the model has 3 stage functions"
    ):
        Pipeline(stages, schedule, make_mesh(2, 1))


def test_refuses_a_batch_the_microbatches_do_not_divide():
    pipe, params, make_batch = _pipeline(jpipe.get_schedule("1f1b", 2, 4))
    packed = pipe.pack(params)
    with pytest.raises(
        ValueError, match=r"batch\['targets'\] has 6 rows, which 4 microbatches do not divide"
    ):
        pipe.value_and_grad(packed, make_batch(6))


def test_refuses_microbatches_the_data_axis_does_not_divide():
    pipe, params, make_batch = _pipeline(jpipe.get_schedule("1f1b", 2, 2), data=2)
    packed = pipe.pack(params)
    with pytest.raises(
        ValueError, match="microbatches of 3 rows cannot be split over the 2-way 'data' axis"
    ):
        pipe.value_and_grad(packed, make_batch(6))


def test_refuses_an_invalid_schedule_before_compiling():
    stages, _, _ = testing.small_model(2)
    bad = jpipe.Schedule.of([["0F0", "0B0"], ["1F0"]])
    with pytest.raises(jpipe.ScheduleError, match="backward of"):
        Pipeline(stages, bad, make_mesh(2, 1))


def test_each_rank_holds_only_its_own_stages():
    pipe, params, _ = _pipeline(jpipe.get_schedule("1f1b", 4, 4))
    packed = pipe.pack(params)
    for name, array in packed.items():
        assert array.shape[0] == 4
        assert array.sharding.spec[0] == "pipe"
        # One row per rank: a device holds 1/4 of the bucket.
        shard = array.addressable_shards[0]
        assert shard.data.shape[0] == 1, name
    # The blocks of stages 1 and 2 share buckets; embedding and head do not.
    round_trip = pipe.unpack(packed)
    for got, want in zip(round_trip, params):
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            np.testing.assert_array_equal(a, np.asarray(b))


def _temp_bytes(name, microbatches):
    schedule = jpipe.get_schedule(name, 4, microbatches)
    pipe, params, make_batch = _pipeline(schedule)
    packed = pipe.pack(params)
    return pipe.compile(packed, make_batch(2 * microbatches)).memory_analysis().temp_size_in_bytes


@pytest.mark.slow
def test_memory_follows_the_schedule():
    # 1F1B keeps at most R activations alive whatever M; GPipe keeps all M.
    # (The batch itself is an argument, not temp memory.)
    one_f_one_b_8, one_f_one_b_64 = _temp_bytes("1f1b", 8), _temp_bytes("1f1b", 64)
    gpipe_8, gpipe_64 = _temp_bytes("gpipe", 8), _temp_bytes("gpipe", 64)
    assert one_f_one_b_64 <= 1.25 * one_f_one_b_8, (one_f_one_b_8, one_f_one_b_64)
    assert gpipe_64 > 3 * gpipe_8, (gpipe_8, gpipe_64)


def test_buffer_slots_match_the_simulated_peak():
    for name, chunks in [("1f1b", 1), ("zb_h2", 1), ("interleaved_1f1b", 2), ("zbv", 2)]:
        schedule = jpipe.get_schedule(name, 4, 8, chunks)
        pipe = Pipeline(testing.small_model(schedule.num_stages)[0], schedule, make_mesh(4, 1))
        peak = max(jpipe.simulate(schedule).peak_activations)
        assert pipe.tick_plan.num_res == peak, name


@pytest.mark.slow
@pytest.mark.parametrize(
    "name,chunks,data", [("1f1b", 1, 1), ("zbv", 2, 2), ("interleaved_1f1b", 2, 1)]
)
def test_forward_only_loss(name, chunks, data):
    schedule = jpipe.get_schedule(name, 2, 4, chunks)
    pipe, params, make_batch = _pipeline(schedule, data=data)
    packed = pipe.pack(params)
    batch = make_batch(8 * data)
    loss, _ = pipe.value_and_grad(packed, batch)
    ref, _ = jpipe.reference_value_and_grad(pipe.stages, params, batch)
    assert abs(float(pipe.loss(packed, batch)) - float(ref)) <= RTOL * abs(float(ref))
    assert float(pipe.loss(packed, batch)) == pytest.approx(float(loss), rel=RTOL)
    # Only forwards: as many ticks as the slowest rank's forwards need, no residual slots.
    forward_plan = pipe.forward_tick_plan
    assert forward_plan.num_res == 0
    assert all(piece[0] == "F" for _, _, piece in forward_plan.pieces())
    assert all(len(pieces) <= 1 for row in forward_plan.ticks for pieces in row)


def _dense_block(params, x, inputs):
    h = jax.numpy.tanh(x @ params["w1"])
    return jax.numpy.tanh(h @ params["w2"]) + inputs["bias"]


@pytest.mark.slow
@pytest.mark.parametrize(
    "wrap", [lambda f: f, jax.jit, jax.checkpoint], ids=["plain", "jit", "remat"]
)
def test_input_and_weight_gradients_are_really_split(wrap):

    params = {"w1": np.ones((16, 64), np.float32), "w2": np.ones((64, 16), np.float32)}
    x = np.ones((4, 16), np.float32)
    kernels = StageKernels.trace(
        wrap(_dense_block), params, x, {"bias": np.ones((4, 16), np.float32)}
    )
    carried = sum(int(np.prod(a.shape)) for a in kernels.carry_avals)
    weights = sum(a.size for a in params.values())
    # W gets the activations and cotangents it needs, never a finished weight
    # gradient, which would mean I did all the work.
    assert carried < weights, (carried, weights)
    assert not {tuple(a.shape) for a in kernels.carry_avals} & {v.shape for v in params.values()}
    assert kernels.i_flops_share < 1.0

    # And the split is exact through a zero-bubble schedule.
    def first(p, x, inputs):
        return inputs["x"] @ p["w"]

    def last(p, x, inputs):
        return jax.numpy.mean((x @ p["w"]) ** 2)

    stages = [first, wrap(_dense_block), last]
    rng = np.random.default_rng(0)
    stage_params = [
        {"w": rng.normal(size=(8, 16)).astype(np.float32) / 4},
        {k: rng.normal(size=v.shape).astype(np.float32) / 8 for k, v in params.items()},
        {"w": rng.normal(size=(16, 2)).astype(np.float32)},
    ]
    batch = {
        "x": rng.normal(size=(8, 8)).astype(np.float32),
        "bias": rng.normal(size=(8, 16)).astype(np.float32),
    }
    schedule = jpipe.Schedule.of(
        [
            [jpipe.F(0, m) for m in range(2)]
            + [x for m in range(2) for x in (jpipe.I(0, m), jpipe.W(0, m))],
            [a for m in range(2) for a in (jpipe.F(1, m), jpipe.F(2, m))]
            + [a for m in range(2) for a in (jpipe.I(2, m), jpipe.I(1, m), jpipe.W(2, m))]
            + [jpipe.W(1, m) for m in range(2)],
        ]
    )
    pipe = Pipeline(stages, schedule, make_mesh(2, 1))
    loss, grads = pipe.value_and_grad(pipe.pack(stage_params), batch)
    ref_loss, ref_grads = jpipe.reference_value_and_grad(stages, stage_params, batch)
    abs_err, rel_err = testing.compare((loss, pipe.unpack(grads)), (ref_loss, ref_grads))
    assert rel_err <= RTOL, (abs_err, rel_err)


def test_compare_counts_nan_as_a_failure():
    ref = (np.float32(1.0), {"a": np.array([1.0, 1.0], np.float32)})
    assert testing.compare(ref, ref) == (0.0, 0.0)
    bad = (np.float32(np.nan), {"a": np.array([1.0, 1.0], np.float32)})
    assert testing.compare(bad, ref)[1] == float("inf")
    bad = (np.float32(1.0), {"a": np.array([np.nan, 1.0], np.float32)})
    assert testing.compare(bad, ref)[1] == float("inf")


def test_refuses_parameters_that_are_not_float_arrays():
    stages, params, _ = testing.small_model(2)
    params[1]["count"] = np.arange(3)
    pipe = Pipeline(stages, jpipe.get_schedule("1f1b", 2, 2), make_mesh(2, 1))
    with pytest.raises(ValueError, match=r"stage 1's parameter \['count'\] is ndarray int64"):
        pipe.pack(params)


def _dots(fn, *args) -> int:
    return str(jax.make_jaxpr(fn)(*args)).count("dot_general")


@pytest.mark.parametrize("first", [True, False])
def test_i_runs_the_backward_chain_and_w_the_weight_products(first):
    # Two dense layers: the backward has two chain products (dy @ w.T) and two
    # weight products (x.T @ dy). A middle stage needs both chain products for
    # its dx; the first stage has no dx, and its I still takes the chain
    # product between its layers, so that I and W cost about the same there.
    def stage(params, x, inputs):
        if first:
            x = inputs["x"]
        h = jax.numpy.tanh(x @ params["w1"])
        return jax.numpy.tanh(h @ params["w2"])

    f32 = jax.numpy.float32
    params = {n: jax.ShapeDtypeStruct((8, 8), f32) for n in ("w1", "w2")}
    act = jax.ShapeDtypeStruct((4, 8), f32)
    inputs = {"x": act}
    k = StageKernels.trace(stage, params, None if first else act, inputs)
    g = [act]
    i_dots = _dots(k.input_grad, params, inputs, k.res_avals, g)
    carry = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in k.carry_avals]
    w_dots = _dots(k.weight_grad, params, inputs, k.res_avals, carry)
    assert (i_dots, w_dots) == ((1, 2) if first else (2, 2))


@pytest.mark.slow
def test_more_microbatches_than_an_int8_table_holds():
    # The table is stored in the narrowest integer type that holds it: int8
    # up to microbatch 127, int16 beyond. 130 microbatches take the int16 path.
    result = testing.check_schedule("1f1b", 2, 130, rows_per_microbatch=1)
    assert result.passed, result


@pytest.mark.slow
def test_packed_shapes_compile_like_packed_arrays():
    # A model too big for the machine is compiled from shapes: they must be
    # exactly what `pack` would place, so the compiled program is the same.
    stages, params, make_batch = testing.small_model(4)
    schedule = jpipe.get_schedule("1f1b", 4, 4)
    pipe = Pipeline(stages, schedule, make_mesh(4))
    shapes = pipe.packed_shapes(jax.eval_shape(lambda: params))
    packed = pipe.pack(params)
    assert shapes.keys() == packed.keys()
    for name, array in packed.items():
        assert (shapes[name].shape, shapes[name].dtype) == (array.shape, array.dtype)
        assert shapes[name].sharding == array.sharding
    batch = jax.device_put(make_batch(8), pipe.batch_sharding)
    step = jax.jit(pipe.step_fn(batch))
    from_shapes = step.lower(shapes, batch).compile().memory_analysis()
    from_arrays = step.lower(packed, batch).compile().memory_analysis()
    assert from_shapes.temp_size_in_bytes == from_arrays.temp_size_in_bytes
    assert from_shapes.argument_size_in_bytes == from_arrays.argument_size_in_bytes


@pytest.mark.slow
def test_an_all_idle_program_runs_nothing():
    # The benchmarks time it to measure the program's control alone.
    stages, params, make_batch = testing.small_model(4)
    schedule = jpipe.get_schedule("1f1b", 4, 4)
    pipe = Pipeline(stages, schedule, make_mesh(4), all_idle=True)
    packed = pipe.pack(params)
    idle = pipe.tick_plan.table(idle=True)
    stage_columns = [jpipe.TickPlan.COLUMNS.index(c) for c in ("f_stage", "i_stage", "w_stage")]
    assert not idle[:, :, stage_columns].any() and pipe.tick_plan.table()[:, :, stage_columns].any()
    loss, grads = pipe.value_and_grad(packed, jax.device_put(make_batch(8), pipe.batch_sharding))
    assert float(loss) == 0.0
    assert all(not np.asarray(g).any() for g in grads.values())
