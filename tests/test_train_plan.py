"""A plan file trains through train.py, and the trainer's profile mode writes a profile."""

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple

import pytest

import jpipe
from jpipe.planner import (
    ClusterPlan,
    DeviceGroup,
    evaluate,
    load_profile,
    plan_file,
    profile_from_stage_times,
)
from jpipe.train.config import ConfigError, TrainConfig

ROOT = Path(__file__).resolve().parent.parent


class StageTimes(NamedTuple):
    F: tuple
    I: tuple
    W: tuple
    B: tuple


def _plan_file(tmp_path) -> Path:
    """A 2-stage plan of 3 measured one-block stages: blocks (2, 1) over pipe=2."""
    times = StageTimes((1.0, 1.0, 2.0), (1.0,) * 3, (1.0,) * 3, (2.0, 2.0, 4.0))
    prof = profile_from_stage_times(times, "cpu", microbatch_size=1, blocks_per_stage=[1, 1, 1])
    ranks = ((DeviceGroup("cpu"),), (DeviceGroup("cpu", node=1),))
    ev = evaluate(ClusterPlan(ranks, ((0, 1), (2,)), 1, 4, "1f1b"), prof)
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(plan_file(ev, prof)))
    return path


def test_plan_sets_the_trainer_config(tmp_path):
    from configs import default

    config = default.get_config()
    config.plan = str(_plan_file(tmp_path))
    config.model.num_layers = 3
    c = TrainConfig.from_config(config)
    assert (c.mesh.pipe, c.mesh.data) == (2, 1) and c.layers_per_stage == "2,1"
    assert (c.schedule, c.num_microbatches, c.batch_size) == ("1f1b", 4, 4)
    tensor = json.loads(Path(config.plan).read_text())
    tensor["mesh"]["tensor"] = 2
    (tmp_path / "tensor.json").write_text(json.dumps(tensor))
    config.plan = str(tmp_path / "tensor.json")
    assert TrainConfig.from_config(config).mesh.tensor == 2  # the plan's degree is applied
    assert TrainConfig.from_config(config).lowering == "spmd"
    # A plan checked with each device holding its own rank's memory runs per rank.
    per_rank = {**tensor, "memory_layout": "mpmd"}
    (tmp_path / "mpmd.json").write_text(json.dumps(per_rank))
    config.plan = str(tmp_path / "mpmd.json")
    assert TrainConfig.from_config(config).lowering == "mpmd"
    # A plan file of an earlier version, whose layout was called "per_rank", is
    # refused with the name it has now.
    (tmp_path / "old.json").write_text(json.dumps({**tensor, "memory_layout": "per_rank"}))
    config.plan = str(tmp_path / "old.json")
    with pytest.raises(ConfigError, match="'per_rank'.*called 'mpmd' now"):
        TrainConfig.from_config(config)
    config.plan = str(_plan_file(tmp_path))
    config.model.num_layers = 4
    with pytest.raises(ConfigError, match="splits 3 transformer blocks .*num_layers=4"):
        TrainConfig.from_config(config)
    config.plan = str(tmp_path / "missing.json")
    with pytest.raises(ConfigError, match="config.plan=.*cannot read plan file"):
        TrainConfig.from_config(config)


@pytest.mark.slow
def test_plan_file_trains_through_train_py(tmp_path):
    plan = _plan_file(tmp_path)
    # configs/ has no `plan` field yet; a user's config file adds it
    cfg = tmp_path / "with_plan.py"
    cfg.write_text(
        "from configs import default\n\n\ndef get_config():\n"
        "    config = default.get_config()\n    config.plan = ''\n    return config\n"
    )
    workdir = tmp_path / "run"
    argv = [
        sys.executable,
        str(ROOT / "train.py"),
        f"--config={cfg}",
        f"--config.plan={plan}",
        f"--workdir={workdir}",
        "--config.steps=2",
        "--config.eval_batches=1",
        "--config.data.max_bytes=32768",
        "--config.model.seq_len=16",
        "--config.model.num_layers=3",
        "--config.model.d_model=32",
        "--config.model.d_ff=64",
    ]
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # train.py fakes its own
    env["XLA_FLAGS"] = "--xla_backend_optimization_level=0"  # as conftest's: faster compiles
    done = subprocess.run(argv, capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "devices: 2 cpu devices" in done.stdout  # faked from the plan's mesh
    assert "1f1b: 2 ranks" in done.stdout
    assert "3 blocks as (2, 1)" in done.stdout
    assert jpipe.planner.read_plan_file(str(plan)).layers_per_stage == (2, 1)


@pytest.mark.slow
def test_profile_mode_writes_the_planner_format(tmp_path):
    """`stage_profile` on measured times (what train.py --config.profile=True writes)."""
    import jax
    import numpy as np

    from jpipe.planner import save_profile
    from jpipe.train.profile import StageTimes as Measured
    from jpipe.train.profile import stage_profile

    class Mesh:
        devices = np.array([[jax.devices()[0]]], dtype=object)

    class Pipeline:  # the two things stage_profile reads from a jpipe.Pipeline
        mesh = Mesh()

        def unpack(self, params):
            return params

    times = Measured(F=(0.1, 0.2), I=(0.15, 0.25), W=(0.05, 0.1), B=(0.2, 0.35))
    params = [{"w": np.zeros(10, np.float32)}, {"w": np.zeros(3, np.float32), "b": np.zeros(1)}]
    prof = stage_profile(Pipeline(), params, times, 2, (2, 1))
    save_profile(prof, str(tmp_path / "profile.json"))
    measured = load_profile(str(tmp_path / "profile.json"))
    assert measured == prof and measured.params == {1: (10.0, 4.0)}
    assert [measured.blocks(l) for l in range(2)] == [2, 1]
    t = measured.layer_times(jax.devices()[0].device_kind, 2, 1)
    assert t.forward == (0.1, 0.2) and t.split() == ((0.15, 0.25), (0.05, 0.1))


@pytest.mark.slow
def test_profile_plan_train_reports_the_planned_footprint(tmp_path):
    """train.py --config.profile=True measures the runtime's memory terms; a plan made from
    that profile for the same setup predicts the compiled step's bytes per device."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    tiny = [
        "--config.steps=1",
        "--config.eval_batches=1",
        "--config.data.max_bytes=32768",
        "--config.model.seq_len=16",
        "--config.model.num_layers=2",
        "--config.model.d_model=32",
        "--config.model.d_ff=64",
    ]
    train = [sys.executable, str(ROOT / "train.py"), f"--config={ROOT / 'configs/default.py'}"]
    work = tmp_path / "profiled"
    argv = [*train, f"--workdir={work}", "--config.profile=True", "--config.mesh.pipe=2"]
    argv += ["--config.mesh.data=1", "--config.batch_size=8", "--config.num_microbatches=4"]
    done = subprocess.run([*argv, *tiny], capture_output=True, text=True, env=env, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    prof = load_profile(str(work / "profile.json"))
    terms = prof.memory_terms
    assert terms.source.startswith("jpipe's runtime, measured") and terms.working_factor > 0
    assert (terms.weight_bytes, terms.optimizer_bytes) == (4.0, pytest.approx(8.0, rel=1e-3))
    assert all(a > 0 for a in prof.activation_bytes[1]) and prof.params[1][0] > 0

    # the planner's plans for 2 such devices; the pipelined one is the profiled setup
    prof = dataclasses.replace(prof, memory={"cpu": 1e9}, derived=set(), _links={})
    found = jpipe.planner.plan(prof, [("cpu", 2)], 8, microbatch_sizes=[2], gpus_per_node=1, top=4)
    piped = next(c.evaluation for c in found.best if c.evaluation.plan.pipe == 2)
    assert piped.plan.num_microbatches == 4
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps(plan_file(piped, prof)))
    argv = [*train, f"--workdir={tmp_path / 'run'}", f"--config.plan={plan}", *tiny]
    done = subprocess.run(argv, capture_output=True, text=True, env=env, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    line = next(x for x in done.stdout.splitlines() if x.startswith("memory: the compiled"))
    assert "planner / compiled = 1.00)" in line, line
    # a setup the profile did not see: microbatches of 4 sequences, not 2
    other = jpipe.planner.plan(prof, [("cpu", 2)], 8, microbatch_sizes=[4], gpus_per_node=1, top=4)
    piped = next(c.evaluation for c in other.best if c.evaluation.plan.pipe == 2)
    plan.write_text(json.dumps(plan_file(piped, prof)))
    argv = [*train, f"--workdir={tmp_path / 'run4'}", f"--config.plan={plan}", *tiny]
    done = subprocess.run(argv, capture_output=True, text=True, env=env, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    line = next(x for x in done.stdout.splitlines() if x.startswith("memory: the compiled"))
    ratio = float(line.rsplit("= ", 1)[1].rstrip(")"))
    assert 0.95 <= ratio <= 1.05, line


def test_a_per_rank_plan_says_which_ranks_each_host_runs(tmp_path, mixed_plan):
    plan = json.loads(mixed_plan.read_text())
    assert plan["processes"] == [
        {"node": 0, "kind": "cpu", "ranks": [0], "devices": 1},
        {"node": 1, "kind": "cpu", "ranks": [1], "devices": 2},
        {"node": 2, "kind": "cpu", "ranks": [2], "devices": 1},
    ]
    assert jpipe.planner.read_plan_file(plan).process_devices == (1, 2, 1)
    # Consecutive ranks on one host are one process; a host whose ranks are apart, two.
    g = lambda node, t=1: (DeviceGroup("cpu", tensor_parallel=t, node=node),)  # noqa: E731
    assert [p["ranks"] for p in jpipe.planner.plan_processes((g(0), g(0, 2), g(1)))] == [
        [0, 1],
        [2],
    ]
    assert [p["node"] for p in jpipe.planner.plan_processes((g(0), g(1), g(0)))] == [0, 1, 0]
    # A rank whose replicas sit on two hosts cannot be one process's.
    split = ((DeviceGroup("cpu", node=0), DeviceGroup("cpu", node=1)),)
    assert jpipe.planner.plan_processes(split) is None
    # Processes that do not match the mesh are refused, naming the field.
    wrong = {**plan, "processes": [{**p, "devices": 2} for p in plan["processes"]]}
    with pytest.raises(ValueError, match="processes gives process 0 2 devices, but its ranks"):
        jpipe.planner.read_plan_file(wrong)
    wrong = {**plan, "processes": [{**plan["processes"][0], "ranks": [0, 2]}]}
    with pytest.raises(ValueError, match="a run of consecutive ranks, together 0 to 2"):
        jpipe.planner.read_plan_file(wrong)
    # jpipe.launch --plan needs a plan that lists its processes.
    bare = tmp_path / "bare.json"
    bare.write_text(json.dumps({k: v for k, v in plan.items() if k != "processes"}))
    done = subprocess.run(
        [sys.executable, "-m", "jpipe.launch", "--plan", str(bare), "--", "train.py"],
        capture_output=True, text=True, cwd=ROOT, timeout=120,
    )  # fmt: skip
    assert done.returncode == 2 and "lists no processes" in done.stderr


@pytest.mark.slow
def test_a_per_rank_plan_launches_as_its_hosts_and_trains_as_one_process(tmp_path, mixed_plan):
    # `jpipe.launch --plan` starts the plan's three processes with 1, 2 and 1 fake
    # devices; train.py gives each its ranks. The losses are the one-process run's of
    # the same plan, bit for bit (each process holds one rank; the gradient norm is
    # summed in rank order, as one process adds it).
    plan = mixed_plan
    flags = [
        f"--config.plan={plan}",
        "--config.steps=4",
        "--config.eval_every=2",
        "--config.log_every=1",
        "--config.eval_batches=1",
        "--config.checkpoint_every=2",
        "--config.data.max_bytes=32768",
        "--config.model.seq_len=16",
        "--config.model.num_layers=3",
        "--config.model.d_model=32",
        "--config.model.d_ff=64",
    ]
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_NUM_CPU_DEVICES")}
    env["XLA_FLAGS"] = "--xla_backend_optimization_level=0"  # as conftest's: faster compiles
    runs = {}
    for name, launcher in (
        ("hosts", [sys.executable, "-m", "jpipe.launch", "--plan", str(plan), "--timeout", "400"]),
        ("one", [sys.executable]),
    ):
        workdir = tmp_path / name
        command = launcher + (["--"] if name == "hosts" else []) + ["train.py"]
        done = subprocess.run(
            command + [f"--workdir={workdir}"] + flags,
            capture_output=True, text=True, env=env, cwd=ROOT, timeout=500,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr[-3000:]
        runs[name] = [json.loads(line) for line in (workdir / "metrics.jsonl").open()]
        runs[name] = [(r["step"], r.get("loss"), r.get("eval_loss")) for r in runs[name]]
        if name == "hosts":
            assert "in 3 processes" in done.stdout
            assert "tensor per rank 1,2,1" in done.stdout
            held = sorted((workdir / "checkpoints" / "4" / "local").glob("_held_by_*.json"))
            assert [p.name for p in held] == [f"_held_by_{i}.json" for i in range(3)]
    assert runs["hosts"] == runs["one"]
    assert [r[0] for r in runs["one"]] == [0, 1, 2, 3, 4]
