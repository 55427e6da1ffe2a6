"""Files jpipe reads are checked strictly: each bad input is refused in one line.

A table of bad inputs and the words their refusal must hold, family by
family: plan files (the trainer's and the planner's), the sizes a schedule
may have, PyTorch schedule CSVs, planner profiles (jpipe's format and
Sailor's), the code a plan file may name, and the planner's unit of memory.
Every case is pure Python and runs in milliseconds; nothing compiles.
"""

import copy
import json
import os
import re
import shutil
from typing import NamedTuple

import pytest

import jpipe
from jpipe import Schedule
from jpipe.plan import main as plan_main
from jpipe.planner import (
    ClusterPlan,
    DeviceGroup,
    evaluate,
    load_profile,
    load_sailor_profile,
    plan,
    plan_file,
    profile_from_json,
    profile_from_stage_times,
    profile_to_json,
    read_plan_file,
)
from jpipe.train.config import ConfigError, TrainConfig, config_from_file

CONFIGS = os.path.join(os.path.dirname(os.path.dirname(__file__)), "configs")
SAILOR = os.path.join(os.path.dirname(jpipe.__file__), "_data", "sailor")


def _one_line(message: str) -> str:
    assert "\n" not in message, f"the refusal is more than one line: {message!r}"
    return message


# --- plan files ----------------------------------------------------------------------------

GOOD_PLAN = {
    "format": "jpipe-plan/1",
    "model": "measured",
    "mesh": {"pipe": 2, "data": 1, "tensor": 1},
    "blocks_per_stage": [3, 3],
    "schedule": "1f1b",
    "num_chunks": None,
    "num_microbatches": 4,
    "global_batch": 8,
    "microbatch_size": 2,
    "memory_layout": "spmd",
    "ranks": [
        [{"kind": "cpu", "tensor_parallel": 1, "gpus_per_node": 1, "node": 0}],
        [{"kind": "cpu", "tensor_parallel": 1, "gpus_per_node": 1, "node": 1}],
    ],
    "stage_layers": [[0, 1, 2], [3, 4, 5]],
    "predicted_seconds": 1.5,
    "predicted_max_mem_bytes": 3e6,
    "devices": [
        {
            "rank": r,
            "replica": 0,
            "kind": "cpu",
            "memory_bytes": None,
            "usable_bytes": None,
            "footprint_bytes": 3e6,
            "parts": {"overhead": 1e6, "parameters": 1e6, "values": 5e5, "working": 5e5},
        }
        for r in range(2)
    ],
}


def _plan(**changes) -> dict:
    """GOOD_PLAN with fields set (``mesh__pipe=2.7`` sets ``mesh.pipe``; `...` removes)."""
    d = copy.deepcopy(GOOD_PLAN)
    for key, value in changes.items():
        *path, last = key.split("__")
        node = d
        for p in path:
            node = node[int(p)] if isinstance(node, list) else node[p]
        if value is ...:
            del node[last]
        elif isinstance(node, list):
            node[int(last)] = value
        else:
            node[last] = value
    return d


PLAN_CASES = [
    # wrong types: a float, a boolean or a string where an integer belongs
    ("pipe 2.7", _plan(mesh__pipe=2.7), r"mesh.pipe must be a JSON integer .*got 2.7"),
    ("pipe true", _plan(mesh__pipe=True), r"mesh.pipe must be a JSON integer .*got True"),
    ("pipe '2'", _plan(mesh__pipe="2"), r"mesh.pipe must be a JSON integer .*got '2'"),
    ("data 0", _plan(mesh__data=0), r"mesh.data must be a JSON integer of at least 1, got 0"),
    ("tensor -1", _plan(mesh__tensor=-1), r"mesh.tensor must be a JSON integer"),
    ("blocks '11'", _plan(blocks_per_stage="11"), r"blocks_per_stage must be a list .*'11'"),
    ("blocks ['3', 3]", _plan(blocks_per_stage=["3", 3]), r"blocks_per_stage\[0\] must be"),
    ("blocks [3.0, 3]", _plan(blocks_per_stage=[3.0, 3]), r"blocks_per_stage\[0\] must be"),
    ("blocks []", _plan(blocks_per_stage=[]), r"blocks_per_stage must be a list"),
    ("blocks [6, 0]", _plan(blocks_per_stage=[6, 0]), r"a stage without a transformer block"),
    ("schedule 5", _plan(schedule=5), r"schedule must be a schedule SPEC .*got 5"),
    ("schedule ''", _plan(schedule=" "), r"schedule must be a schedule SPEC"),
    ("M 0", _plan(num_microbatches=0), r"num_microbatches must be a JSON integer .*got 0"),
    ("M 4.5", _plan(num_microbatches=4.5), r"num_microbatches must be a JSON integer .*4.5"),
    ("B 0", _plan(microbatch_size=0), r"microbatch_size must be a JSON integer .*got 0"),
    ("B null", _plan(microbatch_size=None), r"microbatch_size must be a JSON integer .*None"),
    ("B absent", _plan(microbatch_size=...), r"has no field 'microbatch_size'"),
    ("batch '8'", _plan(global_batch="8"), r"global_batch must be a JSON integer .*'8'"),
    ("batch mismatch", _plan(global_batch=16), r"!= global_batch 16"),
    ("chunks 0", _plan(num_chunks=0), r"num_chunks must be a JSON integer of at least 1"),
    ("chunks 3", _plan(num_chunks=3), r"num_chunks is 3 but blocks_per_stage has 2 stages"),
    ("layout 5", _plan(memory_layout=5), r"memory_layout 5 is not one the trainer runs"),
    ("layout []", _plan(memory_layout=[]), r"memory_layout \[\] is not one the trainer runs"),
    ("model 5", _plan(model=5), r"model must be a string"),
    ("no mesh", _plan(mesh=...), r"has no field 'mesh'"),
    ("mesh a list", _plan(mesh=[2, 1]), r"mesh must be an object"),
    ("no mesh.data", _plan(mesh__data=...), r"has no field 'mesh.data'"),
    ("no format", _plan(format=...), r"is not a jpipe plan: 'format' is None"),
    # unknown fields are refused, with the nearest known one
    ("typo", _plan(num_microbatch=4), r"num_microbatch is not a field .*'num_microbatches'"),
    ("extra", _plan(learning_rate=0.1), r"learning_rate is not a field of a plan file"),
    ("mesh fsdp", _plan(mesh__fsdp=2), r"mesh.fsdp is not a field of a plan file"),
    ("device extra", _plan(devices__0__bandwidth=1), r"devices\[0\].bandwidth is not a field"),
    # non-finite numbers, wherever they are
    ("inf", _plan(predicted_seconds=float("inf")), r"predicted_seconds is inf; .*finite"),
    ("nan", _plan(mesh__pipe=float("nan")), r"mesh.pipe is nan; a plan holds finite numbers"),
    ("-inf", _plan(devices__1__parts__values=float("-inf")), r"devices\[1\].parts.values is -inf"),
    # the planner's record: devices without their footprint, or of the wrong shape
    (
        "no footprint",
        _plan(devices__0__footprint_bytes=...),
        r"devices\[0\].footprint_bytes is missing",
    ),
    (
        "footprint -1",
        _plan(devices__0__footprint_bytes=-1),
        r"footprint_bytes must be a number >= 0",
    ),
    (
        "footprint str",
        _plan(devices__0__footprint_bytes="3e6"),
        r"footprint_bytes must be a number",
    ),
    (
        "devices short",
        _plan(devices=GOOD_PLAN["devices"][:1]),
        r"devices must list one entry per device, .* = 2",
    ),
    ("device rank 5", _plan(devices__1__rank=5), r"devices\[1\] is rank 5 replica 0, outside"),
    ("device no kind", _plan(devices__0__kind=""), r"devices\[0\].kind must name a device type"),
    ("ranks short", _plan(ranks=GOOD_PLAN["ranks"][:1]), r"ranks must list mesh.pipe=2 ranks"),
    (
        "ranks tp 0",
        _plan(ranks__0__0__tensor_parallel=0),
        r"ranks\[0\]\[0\].tensor_parallel must be",
    ),
    (
        "stage layers",
        _plan(stage_layers=[[0, 1, 2]]),
        r"stage_layers must list the layers of each of the 2",
    ),
    # sizes that would take minutes: refused with the limit named
    (
        "M 10^9",
        _plan(num_microbatches=10**9, global_batch=2 * 10**9),
        r"num_microbatches is too large: .*MAX_ACTIONS=4,194,304",
    ),
    ("pipe 10^6", _plan(mesh__pipe=10**6), r"mesh takes 1,000,000 devices, .*MAX_PLAN_DEVICES"),
    (
        "pipe 5000",
        _plan(
            mesh__pipe=5000,
            blocks_per_stage=[1] * 5000,
            ranks=...,
            stage_layers=...,
            devices=...,
            global_batch=8,
        ),
        r"mesh.pipe is too large: .*MAX_RANKS=4096",
    ),
    ("data 10^6", _plan(mesh__data=10**6, global_batch=8 * 10**6), r"mesh takes 2,000,000 devices"),
    (
        "tensor_per_rank",
        _plan(mesh__tensor_per_rank="12"),
        r"mesh.tensor_per_rank must list one whole number",
    ),
]


def test_the_good_plan_is_read():
    s = read_plan_file(copy.deepcopy(GOOD_PLAN))
    assert (s.pipe, s.data, s.layers_per_stage, s.num_microbatches) == (2, 1, (3, 3), 4)


@pytest.mark.parametrize(
    "plan_json, expected", [c[1:] for c in PLAN_CASES], ids=[c[0] for c in PLAN_CASES]
)
def test_a_bad_plan_is_refused_naming_the_file_and_field(tmp_path, plan_json, expected):
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(plan_json))
    with pytest.raises(ValueError, match=expected) as e:
        read_plan_file(str(path))
    assert _one_line(str(e.value)).startswith(str(path))


@pytest.mark.parametrize(
    "text, expected",
    [
        ("[1, 2]", r"plan.json is not a jpipe plan: it holds a JSON list, not an object"),
        ('"plan"', r"it holds a JSON str, not an object"),
        ("{", r"plan.json' is not JSON"),
        ("\xff\xfe", r"is not JSON"),
    ],
    ids=["list", "string", "truncated", "not text"],
)
def test_a_plan_that_is_not_an_object_is_refused(tmp_path, text, expected):
    path = tmp_path / "plan.json"
    path.write_bytes(text.encode("latin-1"))
    with pytest.raises(ValueError, match=expected) as e:
        read_plan_file(str(path))
    _one_line(str(e.value))


def test_a_device_kind_jpipe_does_not_know_is_warned_about():
    odd = _plan(ranks__0__0__kind="H900-1TB", devices__0__kind="H900-1TB")
    with pytest.warns(UserWarning, match=r"ranks\[0\]\[0\].kind 'H900-1TB' is neither a device"):
        read_plan_file(odd)
    for kind in ("A100-40", "cpu", "NVIDIA H100 80GB HBM3", "TPU v4"):
        read_plan_file(_plan(ranks__0__0__kind=kind, devices__0__kind=kind))  # no warning


def test_what_the_planner_writes_reads_back_strictly(tmp_path):
    """The writer's every field is one the strict reader knows."""
    times = StageTimes((1.0, 1.0, 2.0), (1.0,) * 3, (1.0,) * 3, (2.0, 2.0, 4.0))
    prof = profile_from_stage_times(times, "cpu", microbatch_size=1, blocks_per_stage=[1, 1, 1])
    ranks = ((DeviceGroup("cpu"),), (DeviceGroup("cpu", node=1),))
    ev = evaluate(ClusterPlan(ranks, ((0, 1), (2,)), 1, 4, "1f1b"), prof)
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(plan_file(ev, prof)))
    assert read_plan_file(str(path)).layers_per_stage == (2, 1)


# --- the trainer: a plan refused before anything compiles, and code in a plan ------------


def _trainer_config(tmp_path, **changes):
    plan_json = _plan(devices=..., ranks=..., stage_layers=..., **changes)
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(plan_json))
    config = config_from_file(os.path.join(CONFIGS, "default.py"))
    config.plan = str(path)
    config.model.num_layers = 6
    return config


def test_the_trainer_refuses_a_bad_plan_in_one_line(tmp_path):
    config = _trainer_config(tmp_path, mesh__pipe=2.7)
    with pytest.raises(ConfigError, match=r"config.plan=.*mesh.pipe must be a JSON integer"):
        TrainConfig.from_config(config)
    bad = _plan(devices__0__footprint_bytes=...)
    (tmp_path / "plan.json").write_text(json.dumps(bad))
    config.model.num_layers = 6
    with pytest.raises(ConfigError, match=r"devices\[0\].footprint_bytes is missing") as e:
        TrainConfig.from_config(config)
    _one_line(str(e.value))


@pytest.mark.parametrize(
    "spec", ["evil.py:fn", "evil.py:fn:warmup=2", "dir/evil.py:make"], ids=["fn", "options", "dir"]
)
def test_a_plan_naming_code_is_refused_unless_trusted(tmp_path, spec):
    marker = tmp_path / "ran"
    evil = tmp_path / "evil.py"
    evil.write_text(f"open({str(marker)!r}, 'w').close()\ndef fn(r, m, warmup=1): return []\n")
    config = _trainer_config(tmp_path, schedule=spec)
    with pytest.raises(ConfigError, match=r"is code .*--config.trust_plan=True") as e:
        TrainConfig.from_config(config)
    _one_line(str(e.value))
    assert not marker.exists()  # refused without running it
    config.trust_plan = True
    assert TrainConfig.from_config(config).schedule == spec
    config.trust_plan = False
    config.schedule = spec  # the user names the same code on the command line
    assert TrainConfig.from_config(config).schedule == spec
    raw = config.to_dict()
    raw["trust_plan"] = "yes"
    with pytest.raises(ConfigError, match=r"config.trust_plan='yes': must be True or False"):
        TrainConfig.from_config(raw)


def test_a_plan_naming_data_needs_no_trust(tmp_path):
    for spec in ("1f1b", "zb_h1:lag=1", "my_schedule.csv"):
        config = _trainer_config(tmp_path, schedule=spec)
        assert TrainConfig.from_config(config).schedule == spec


# --- sizes a schedule may have -------------------------------------------------------------

SIZE_CASES = [
    (
        ("1f1b", 4, 10**9),
        r"'1f1b': 4 ranks x 1000000000 microbatches make at least 8,000,000,000 actions, "
        r"more than jpipe's limit of MAX_ACTIONS=4,194,304",
    ),
    (("1f1b", 10**6, 8), r"1000000 ranks is more than jpipe's limit of MAX_RANKS=4096"),
    (("gpipe", 4097, 1), r"4097 ranks is more than jpipe's limit of MAX_RANKS=4096"),
    (("interleaved_1f1b", 8, 2**18, 2), r"8 ranks x 2 stages per rank x 262144 microbatches"),
    (("zb_h1", 1024, 4096), r"MAX_ACTIONS=4,194,304"),
]


@pytest.mark.parametrize("args, expected", SIZE_CASES, ids=["M 1e9", "R 1e6", "R 4097", "V", "RM"])
def test_a_schedule_too_large_to_build_is_refused_at_once(args, expected):
    with pytest.raises(ValueError, match=expected) as e:
        jpipe.get_schedule(*args)
    _one_line(str(e.value))


def test_a_users_function_is_held_to_the_limits(tmp_path):
    big = tmp_path / "big.py"
    big.write_text("def fn(r, m):\n    return [['0F0'] * 5] * 5000\n")
    with pytest.raises(ValueError, match=r"returned 5000 ranks .*MAX_RANKS=4096"):
        jpipe.get_schedule(f"{big}:fn", 2, 1)


def test_the_trainer_refuses_a_huge_microbatch_count_before_building():
    config = config_from_file(os.path.join(CONFIGS, "default.py"))
    config.num_microbatches = 10**9
    config.batch_size = 10**9
    c = TrainConfig.from_config(config)  # a number: fine until the schedule is built
    with pytest.raises(ValueError, match="MAX_ACTIONS"):
        jpipe.get_schedule(c.schedule, c.mesh.pipe, c.num_microbatches)


# --- schedule CSVs -------------------------------------------------------------------------

TWO_RANKS = Schedule.of([["0F0", "0B0"], ["1F0", "1B0"]])


@pytest.mark.parametrize(
    "text",
    [
        "0F0,0B0\n1F0,1B0\n",
        "0F0,0B0\r\n1F0,1B0\r\n",
        "0F0,0B0\r1F0,1B0\r",
        "0F0,0B0\r1F0,1B0",
        "\ufeff0F0,0B0\n1F0,1B0",
        "0F0,0B0\n\r\n1F0,1B0\n"[:8] + "1F0,1B0\n",
    ],
    ids=["LF", "CRLF", "CR", "CR, no last", "BOM", "mixed"],
)
def test_a_csv_with_any_line_ending_is_read(tmp_path, text):
    path = tmp_path / "s.csv"
    path.write_bytes(text.encode("utf-8"))
    assert Schedule.from_csv(path) == TWO_RANKS
    assert jpipe.get_schedule(str(path)) == TWO_RANKS


CSV_CASES = [
    ("0F0,0X0", r"s.csv row 1 column 2: cannot read schedule cell '0X0'"),
    ("0F0,0B0\n1F0,F1", r"s.csv row 2 column 2: cannot read schedule cell 'F1'"),
    ("0F0,0B0\r1F0,1B-1", r"s.csv row 2 column 2: cannot read schedule cell '1B-1'"),
    ("0F0,0B0\n1F0,1F0.x", r"row 2 column 2: cannot read schedule cell '1F0.x'"),
    ("0F0,0B0\n1F0,1F0.5", r"row 1 column 1: cell '0F0' names no slice, where other cells do"),
    ('0F0,"0B0', r"s.csv row 1: not CSV \(unexpected end of data\)"),
    ('0F0,"0B0"x', r"s.csv row 1: not CSV"),
    ("0F0,0EVICT0", r"row 1 column 2: .*EVICT needs @PARTNER"),
    ("0F0,0B0@1", r"row 1 column 2: .*B takes no @PARTNER"),
    ("0F99999999999,0B0", r"row 1 column 1: 0F99999999999: microbatch 99,999,999,999 is past"),
    ("99999999F0,99999999B0", r"row 1 column 1: .*stage 99,999,999 is past"),
    ("0EVICT0@99999,0LOAD0@99999", r"row 1 column 1: .*partner rank 99,999 is past"),
    ("\n".join(["0F0,0B0"] * 4097), r"s.csv row 4097: more than jpipe's limit of MAX_RANKS=4096"),
    ("0F0,1SEND_F0", r"row 1 column 2: '1SEND_F0' names stage 1, which this rank does not"),
]


@pytest.mark.parametrize(
    "text, expected", CSV_CASES, ids=[f"csv{i}" for i in range(len(CSV_CASES))]
)
def test_a_bad_csv_is_refused_naming_row_and_column(tmp_path, text, expected):
    path = tmp_path / "s.csv"
    path.write_text(text, newline="")
    with pytest.raises(ValueError, match=expected) as e:
        Schedule.from_csv(path)
    _one_line(str(e.value))


def test_a_csv_of_too_many_cells_is_refused_before_its_cells_are_read():
    text = ",".join(["0F0"] * (2**22 + 1))
    with pytest.raises(ValueError, match=r"big.csv: at least 4,194,305 cells, past .*MAX_ACTIONS"):
        Schedule.from_csv_text(text, "big.csv")


# --- planner profiles ----------------------------------------------------------------------


class StageTimes(NamedTuple):  # the trainer's measured stage times, by shape
    F: tuple
    I: tuple
    W: tuple
    B: tuple


def _profile_json() -> dict:
    times = StageTimes((1e-3, 2e-3), (1e-3, 2e-3), (1e-3, 1e-3), (2e-3, 3e-3))
    prof = profile_from_stage_times(
        times,
        "cpu",
        microbatch_size=4,
        params=[1e6, 2e6],
        activation_bytes=[4e6, 8e6],
        output_bytes=[4e5, 4e5],
        memory_bytes=8e9,
        link_bytes_per_s=1e10,
    )
    return json.loads(json.dumps(profile_to_json(prof)))


def _profile(path: str, value) -> dict:
    """The good profile with the field at dotted `path` set to `value` (`...` removes it)."""
    d = _profile_json()
    *parents, last = path.split(".")
    node = d
    for p in parents:
        node = node[int(p)] if isinstance(node, list) else node[p]
    if value is ...:
        del node[int(last) if isinstance(node, list) else last]
    elif isinstance(node, list):
        node[int(last)] = value
    else:
        node[last] = value
    return d


TIMES = "devices.cpu.times.0"
PROFILE_CASES = [
    # implausible units: far outside any device's range
    (
        "memory in GiB",
        "devices.cpu.memory_bytes",
        40,
        r"devices.cpu.memory_bytes is 40, outside the plausible .*device_bytes: .*write 8e9, not 8",
    ),
    ("memory 0", "devices.cpu.memory_bytes", 0, r"devices.cpu.memory_bytes is 0, outside"),
    (
        "memory -1",
        "devices.cpu.memory_bytes",
        -1,
        r"memory_bytes is -1; it must be a finite number >= 0",
    ),
    (
        "memory str",
        "devices.cpu.memory_bytes",
        "8e9",
        r"memory_bytes is '8e9'; it must be a number",
    ),
    ("memory bool", "devices.cpu.memory_bytes", True, r"memory_bytes is True; it must be a number"),
    (
        "act in GiB",
        "activation_bytes.1",
        [0.004, 0.008],
        r"activation_bytes\[1\]\[0\] is 0.004, outside .*given as bytes",
    ),
    (
        "act 1e15",
        "activation_bytes.1",
        [1e15, 1.0],
        r"activation_bytes\[1\]\[0\] is 1e\+15, outside .*a total rather than one layer",
    ),
    (
        "output -4",
        "output_bytes",
        [-4, 1],
        r"output_bytes\[0\] is -4; it must be a finite number >= 0",
    ),
    ("params in M", "params.1", [0.5, 2.0], r"params\[1\]\[0\] is 0.5, outside .*millions"),
    ("params str", "params.1", ["1e6", 2e6], r"params\[1\]\[0\] is '1e6'; it must be a number"),
    (
        "params T 0",
        "params",
        {"0": [1e6, 2e6]},
        r"params key '0' must be a whole number of at least 1",
    ),
    ("params T x", "params", {"x": [1e6, 2e6]}, r"params key 'x' must be a whole number"),
    ("params empty", "params", {}, r"params is empty"),
    ("act short", "activation_bytes.1", [1e6], r"activation_bytes\[1\] has 1 values, expected 2"),
    (
        "ms as s",
        f"{TIMES}.forward",
        [50.0, 5000.0],
        r"forward\[1\] is 5000, outside .*milliseconds or microseconds given as seconds\?",
    ),
    ("hours as s", f"{TIMES}.backward", [1e-12, 1e-3], r"backward\[0\] is 1e-12, outside"),
    (
        "time nan",
        f"{TIMES}.update",
        [float("nan"), 0.0],
        r"update\[0\] is nan; it must be a finite",
    ),
    (
        "time inf",
        f"{TIMES}.forward",
        [float("inf"), 0.0],
        r"forward\[0\] is inf; it must be a finite",
    ),
    ("time str", f"{TIMES}.input_grad", ["1", 0.0], r"input_grad\[0\] is '1'; it must be a number"),
    ("time a dict", f"{TIMES}.forward", {"0": 1.0}, r"forward must be a list"),
    (
        "B 0",
        f"{TIMES}.microbatch_size",
        0,
        r"times\[0\].microbatch_size must be a whole number of at least 1",
    ),
    ("T str", f"{TIMES}.tensor_parallel", "1", r"times\[0\].tensor_parallel must be an integer"),
    ("T bool", f"{TIMES}.tensor_parallel", True, r"times\[0\].tensor_parallel must be an integer"),
    (
        "no forward",
        f"{TIMES}.forward",
        ...,
        r"missing the field 'devices.cpu.times\[B=4, T=1\].forward'",
    ),
    (
        "times field",
        f"{TIMES}.fwd",
        [1.0, 1.0],
        r"times\[0\].fwd is not a field of a jpipe profile",
    ),
    ("top field", "bandwidth", 1, r"bandwidth is not a field of a jpipe profile"),
    ("device field", "devices.cpu.flops", 1, r"devices.cpu.flops is not a field"),
    ("layer kind", "layer_kinds", ["block", "blok"], r"layer_kinds\[1\] is 'blok'; accepted"),
    ("layer blocks", "layer_blocks", [1, 1.5], r"layer_blocks\[1\] must be a whole number"),
    (
        "GB/s as B/s",
        "intra_node.0.max_bytes_per_s",
        25,
        r"intra_node\[0\].max_bytes_per_s is 25, outside .*GB/s or MB/s given as bytes/s",
    ),
    (
        "link nan",
        "inter_node.0.max_bytes_per_s",
        float("nan"),
        r"inter_node\[0\].max_bytes_per_s is nan",
    ),
    (
        "link coeff",
        "inter_node.0.coeffs",
        ["a"],
        r"inter_node\[0\].coeffs\[0\] must be a finite number",
    ),
    (
        "gpus 0",
        "intra_node.0.gpus",
        0,
        r"intra_node\[0\].gpus must be a whole number of at least 1",
    ),
    (
        "terms str",
        "memory_terms.weight_bytes",
        "4",
        r"memory_terms cannot be read: memory term weight_bytes is '4'",
    ),
    (
        "terms field",
        "memory_terms.flops",
        1.0,
        r"memory_terms cannot be read: unknown memory terms",
    ),
    ("model 5", "model", 5, r"model must be a string, got 5"),
    ("devices list", "devices", [], r"devices must be an object"),
]


@pytest.mark.parametrize(
    "field, value, expected", [c[1:] for c in PROFILE_CASES], ids=[c[0] for c in PROFILE_CASES]
)
def test_a_bad_profile_is_refused_naming_the_file_and_field(tmp_path, field, value, expected):
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(_profile(field, value)))
    with pytest.raises(ValueError, match=expected) as e:
        load_profile(str(path))
    assert _one_line(str(e.value)).startswith(str(path))


def test_the_good_profile_reads_and_free_links_stay_free(tmp_path):
    assert profile_from_json(_profile_json()).memory == {"cpu": 8e9}
    unmeasured = _profile("intra_node.0.max_bytes_per_s", float("inf"))  # written as Infinity
    assert profile_from_json(json.loads(json.dumps(unmeasured))).intra["cpu"][
        1
    ].max_bytes_per_s == float("inf")
    with pytest.raises(
        ValueError, match=r"the profile is not a jpipe profile: it holds a JSON list"
    ):
        profile_from_json([])


@pytest.mark.parametrize(
    "file, edit, expected",
    [
        (
            "llm_info.json",
            lambda d: d["OPT-350"]["1"]["0"].update(params_floats="x"),
            r"llm_info.json: OPT-350.1.0.params_floats is 'x'; it must be a number",
        ),
        (
            "llm_info.json",
            lambda d: d["OPT-350"]["1"]["3"].update(act_mem_floats=-1),
            r"llm_info.json: OPT-350.1.3.act_mem_floats is -1; it must be a finite number >= 0",
        ),
        (
            "profiles/OPT-350/A100-40/profile.json",
            lambda d: d["1"]["1"]["2"].__setitem__(0, 5000.0),
            r"A100-40/profile.json: 1.1.2\[0\] is 5000, outside the plausible",
        ),
        (
            "profiles/OPT-350/A100-40/profile.json",
            lambda d: d["1"]["1"]["2"].__setitem__(1, None),
            r"A100-40/profile.json: 1.1.2\[1\] is None; it must be a number",
        ),
        (
            "network/intra_node_bandwidths.json",
            lambda d: next(iter(next(iter(d.values())).values())).__setitem__(1, 25),
            r"intra_node_bandwidths.json: .* peak is 25, outside .*GB/s or MB/s given as bytes/s",
        ),
    ],
    ids=["params str", "negative bytes", "ms as s", "null time", "GB/s"],
)
def test_a_bad_sailor_file_is_refused_naming_it(tmp_path, file, edit, expected):
    root = tmp_path / "sailor"
    (root / "profiles").mkdir(parents=True)
    shutil.copytree(os.path.join(SAILOR, "network"), root / "network")
    shutil.copytree(os.path.join(SAILOR, "profiles", "OPT-350"), root / "profiles" / "OPT-350")
    shutil.copy(os.path.join(SAILOR, "llm_info.json"), root / "llm_info.json")
    load_sailor_profile("OPT-350", str(root))  # the copy reads as it is
    d = json.loads((root / file).read_text())
    edit(d)
    (root / file).write_text(json.dumps(d))
    with pytest.raises(ValueError, match=expected) as e:
        load_sailor_profile("OPT-350", str(root))
    _one_line(str(e.value))


@pytest.mark.parametrize(
    "memory, expected",
    [
        ("cpu:8", r"--memory: cpu's memory is 8, outside the plausible"),
        ("cpu:1e20", r"--memory: cpu's memory is 1e\+20, outside"),
        ("cpu:x", r"--memory: cannot read 'cpu:x'"),
    ],
    ids=["GiB as bytes", "too large", "not a number"],
)
def test_the_planners_memory_flag_is_plausible(tmp_path, capsys, memory, expected):
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(_profile_json()))
    argv = ["--model", "measured", "--devices", "cpu:2", "--global-batch", "8"]
    assert plan_main([*argv, "--profiles", str(path), "--memory", memory]) == 2
    err = capsys.readouterr().err
    assert re.search(expected, err) and err.count("\n") == 1, err


# --- the planner's unit of memory ----------------------------------------------------------


def test_the_planner_writes_memory_in_gib_only(tmp_path, capsys):
    prof = profile_from_json(_profile_json())
    found = plan(prof, [("cpu", 2)], 8, gpus_per_node=1)
    text = "\n".join(found.best[0].reasons)
    assert "GiB" in text and not re.search(r"\bGB\b", text), text
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(_profile_json()))
    argv = ["--model", "measured", "--devices", "cpu:2", "--global-batch", "8"]
    assert plan_main([*argv, "--profiles", str(path)]) == 0
    out = capsys.readouterr().out
    assert "memory in GiB (2^30 bytes)" in out and not re.search(r"\bGB\b", out), out


def test_a_loss_stage_passing_on_a_fraction_of_a_byte_a_sequence_is_read():
    # The last stage passes on its 4-byte loss per microbatch: with 8
    # sequences a microbatch that is half a byte a sequence, which the
    # trainer's profile writes and the planner must read.
    import json
    import pathlib

    from jpipe.planner import profiles as _profiles

    path = pathlib.Path(__file__).parent / "data" / "train_profile.json"
    data = json.loads(path.read_text())
    data["output_bytes"][-1] = 4 / 8
    assert _profiles.profile_from_json(data).output_bytes[-1] == 0.5
    data["output_bytes"][-1] = 1e-9  # not a size in any unit
    with pytest.raises(ValueError, match=r"output_bytes\[3\]"):
        _profiles.profile_from_json(data)


# --- any JSON file a user gives: one reader, one line naming the kind, the file and the place --


def _sailor_info(path):
    os.makedirs(os.path.join(os.path.dirname(path), "profiles", "X"))
    return load_sailor_profile("X", os.path.dirname(path))


JSON_FILES = [
    ("plan file", "plan.json", read_plan_file),
    ("profile", "profile.json", load_profile),
    ("profile", "stages.json", jpipe.load_stage_profile),
    ("Sailor plan file", "plan_config_N1_D1.json", jpipe.planner.load_sailor_plan),
    ("Sailor file", "llm_info.json", _sailor_info),
]
JSON_IDS = ["plan", "profile", "stage profile", "Sailor plan", "Sailor"]


@pytest.mark.parametrize("kind, name, read", JSON_FILES, ids=JSON_IDS)
@pytest.mark.parametrize(
    "text, place",
    [
        # Python 3.13's json names the comma, earlier ones the brace after it
        (
            b'{\n  "format": 2,\n}',
            r"is not JSON: (Expecting property name .*: line 3 column 1 "
            r"|Illegal trailing comma .*: line 2 column 14 )",
        ),
        (b'{\n  "format": "\xff"}', r"is not JSON: not UTF-8 text at line 2 column 14 \(byte 0xff"),
        (b"", r"is not JSON: Expecting value: line 1 column 1 "),
    ],
    ids=["trailing comma", "not UTF-8", "empty"],
)
def test_a_file_that_is_not_json_is_refused_naming_kind_file_and_place(
    tmp_path, kind, name, read, text, place
):
    path = tmp_path / name
    path.write_bytes(text)
    with pytest.raises(ValueError, match=f"^{re.escape(f'{kind} {str(path)!r}')} {place}") as e:
        read(str(path))
    _one_line(str(e.value))


@pytest.mark.parametrize("kind, name, read", JSON_FILES, ids=JSON_IDS)
def test_a_missing_file_is_refused_naming_kind_and_file(tmp_path, kind, name, read):
    path = tmp_path / name
    with pytest.raises(ValueError, match=f"^cannot read {re.escape(f'{kind} {str(path)!r}')}: "):
        read(str(path))


def test_a_json_file_may_start_with_a_byte_order_mark(tmp_path):
    path = tmp_path / "plan.json"
    path.write_bytes(b"\xef\xbb\xbf" + json.dumps(GOOD_PLAN).encode())
    assert read_plan_file(str(path)).pipe == 2
