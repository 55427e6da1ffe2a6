"""Checkpoints of arrays each held by one process, across real processes (jpipe.launch).

The state is laid out as the trainer's is with a mesh per rank: the step on
rank 0's devices, each rank's buckets of parameters and optimizer state on its
own devices (rank 0 split over the 2 devices of process 0, ranks 1 and 2 on
one device each of process 1), and one global array over every device.
`jpipe.train.checkpoint.Checkpoints` saves it from 2 processes; a new launch
reads it back bit for bit, with the ranks where they were or moved to the
other process; a process killed (SIGKILL) in the middle of writing a step
leaves the step before it whole; a step missing a process's files is moved
aside at the next start.

Run as a script (``python tests/test_process_arrays.py MODE DIR``) it is one
process of such a launch.
"""

import json
import os
import signal
import subprocess
import sys

import pytest

import jpipe

ENV = {**os.environ, "JAX_PLATFORMS": "cpu"}
LAUNCH_SECONDS = 240


def _state(step: int, moved: bool, concrete: bool):
    """The state of `step` (values drawn from it), or its shapes and shardings."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from jpipe.train.step import TrainState

    devices = sorted(jax.devices(), key=lambda d: d.id)
    of = [[d for d in devices if d.process_index == p] for p in (0, 1)]
    a, b = (of[1], of[0]) if moved else (of[0], of[1])
    meshes = [Mesh(np.array(a), ("tensor",)), Mesh(np.array(b[:1]), ("tensor",))]
    meshes.append(Mesh(np.array(b[1:]), ("tensor",)))
    rng = np.random.default_rng(step)

    def array(mesh, shape, dtype, spec):
        full = rng.standard_normal(shape).astype(dtype)
        sharding = NamedSharding(mesh, spec)
        if not concrete:
            return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)
        return jax.make_array_from_callback(shape, sharding, lambda i: full[i], dtype=full.dtype)

    def buckets(mesh):
        return {
            "float32": array(mesh, (1, 6, 4), np.float32, P(None, None, "tensor")),
            "bfloat16": array(mesh, (1, 5), jnp.bfloat16, P()),
        }

    params = [buckets(m) for m in meshes]
    moments = [(buckets(m), buckets(m)) for m in meshes]
    everywhere = Mesh(np.array(devices), ("all",))
    moments.append(array(everywhere, (8, 3), np.float32, P("all")))
    sharding = NamedSharding(meshes[0], P())
    count = np.asarray(step, np.int32)
    if concrete:
        count = jax.make_array_from_callback((), sharding, lambda i: count, dtype=count.dtype)
    else:
        count = jax.ShapeDtypeStruct((), np.int32, sharding=sharding)
    return TrainState(count, params, moments)


def _same(restored, expected) -> list[str]:
    """The leaves whose shards here differ from the expected ones' (values or dtype)."""
    import jax
    import numpy as np

    wrong = []
    for i, (r, e) in enumerate(zip(jax.tree.leaves(restored), jax.tree.leaves(expected))):
        if r.sharding != e.sharding or len(r.addressable_shards) != len(e.addressable_shards):
            wrong.append(f"leaf {i}: placed {r.sharding}, not {e.sharding}")
            continue
        for x, y in zip(r.addressable_shards, e.addressable_shards):
            if x.data.dtype != y.data.dtype or not np.array_equal(
                np.asarray(x.data), np.asarray(y.data)
            ):
                wrong.append(f"leaf {i} on {x.device}")
    return wrong


def _worker(mode: str, directory: str) -> None:
    jpipe.initialize_distributed()
    import jax

    from jpipe.train import process_arrays
    from jpipe.train.checkpoint import Checkpoints

    me = jax.process_index()
    checkpoints = Checkpoints(directory)
    result = {"process": me}
    if mode == "save":
        for step in (1, 2):
            checkpoints.save(step, _state(step, False, True), {"note": "test"})
        result["steps"] = checkpoints.complete_steps()
    elif mode == "save_killed":  # step 3: process 1 dies after its first array is written
        if me == 1:
            save = process_arrays.ProcessArraysHandler.save

            def dies(self, directory, args):
                first = dict([(n, x) for n, x in sorted(args.arrays.items()) if n != "step"][-1:])
                save(self, directory, process_arrays.ProcessArraysSave(first))
                os.kill(os.getpid(), signal.SIGKILL)

            process_arrays.ProcessArraysHandler.save = dies
        checkpoints.save(3, _state(3, False, True), {"note": "test"})
    else:  # restore, restore_moved
        moved = mode == "restore_moved"
        result["removed"] = checkpoints.remove_incomplete()
        step = checkpoints.latest_step()
        result["latest"] = step
        restored = checkpoints.restore(step, _state(step, moved, False))
        result["wrong"] = _same(restored, _state(step, moved, True))
        result["local_leaves"] = sum(
            process_arrays.held_by_one_process(x) for x in jax.tree.leaves(restored)
        )
        result["damaged"] = sorted(n for n in os.listdir(directory) if n.endswith(".damaged"))
    checkpoints.close()
    print("RESULT " + json.dumps(result), flush=True)


def _launch(mode: str, directory):
    out = subprocess.run(
        [sys.executable, "-m", "jpipe.launch", "-n", "2", "--cpu_devices", "2",
         "--timeout", str(LAUNCH_SECONDS), "--", __file__, mode, str(directory)],
        env=ENV, capture_output=True, text=True, timeout=LAUNCH_SECONDS + 60,
    )  # fmt: skip
    results = [
        json.loads(line.split("RESULT ", 1)[1])
        for line in out.stdout.splitlines()
        if "RESULT " in line
    ]
    if not results and out.returncode == 0:
        pytest.fail(out.stdout[-3000:] + out.stderr[-3000:])
    return out.returncode, sorted(results, key=lambda r: r["process"]), out


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    directory = tmp_path_factory.mktemp("checkpoints")
    status, results, out = _launch("save", directory)
    assert status == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return directory, results


def test_each_process_writes_the_arrays_it_holds(saved):
    directory, results = saved
    assert [r["steps"] for r in results] == [[1, 2], [1, 2]]
    local = directory / "2" / "local"
    held = {p: json.loads((local / f"_held_by_{p}.json").read_text()) for p in (0, 1)}
    # Process 0 holds rank 0 (its step, parameters and two moments: 2 buckets each);
    # process 1 ranks 1 and 2; the global array is orbax's.
    assert len(held[0]) == 1 + 3 * 2 and len(held[1]) == 2 * 3 * 2
    assert "step" in held[0] and "params.1.float32" in held[1] and "params.2.bfloat16" in held[1]
    assert held[0]["params.0.float32"] == [[1, 6, 4], "float32"]
    assert held[1]["params.2.bfloat16"] == [[1, 5], "bfloat16"]
    assert (directory / "2" / "state" / "_METADATA").is_file()
    assert not any(n.startswith("opt_state.3") for n in held[0] | held[1])


@pytest.mark.parametrize("mode", ["restore", "restore_moved"])
def test_a_new_launch_reads_every_array_back_bit_for_bit(saved, mode):
    directory, _ = saved
    status, results, out = _launch(mode, directory)
    assert status == 0, out.stdout[-3000:] + out.stderr[-3000:]
    for r in results:
        assert r["latest"] == 2 and r["removed"] == [] and r["damaged"] == []
        assert r["wrong"] == [], r
    # Moved: rank 0 now lives on process 1, ranks 1 and 2 on process 0: each reads
    # what the other wrote.
    assert [r["local_leaves"] for r in results] == [19, 19]


def test_a_process_killed_while_saving_leaves_the_step_before(tmp_path):
    status, _, out = _launch("save", tmp_path)
    assert status == 0, out.stderr[-3000:]
    status, _, out = _launch("save_killed", tmp_path)
    assert status != 0  # process 1 was killed, and the launcher stopped process 0
    assert not (tmp_path / "3").exists()
    status, results, out = _launch("restore", tmp_path)
    assert status == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert [(r["latest"], r["wrong"]) for r in results] == [(2, []), (2, [])]


def test_a_step_missing_a_process_s_files_is_moved_aside(saved, tmp_path):
    import shutil

    directory = tmp_path / "copy"
    shutil.copytree(saved[0], directory)
    for name in ("_held_by_1.json",):
        os.remove(directory / "2" / "local" / name)
    os.remove(directory / "2" / "jpipe_files.json")  # as if killed before recording sizes
    status, results, out = _launch("restore", directory)
    assert status == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert [(r["latest"], r["wrong"], r["damaged"]) for r in results] == [
        (1, [], ["2.damaged"]),
        (1, [], ["2.damaged"]),
    ]
    assert "_held_by_1.json is missing" in out.stderr


if __name__ == "__main__":
    _worker(sys.argv[1], sys.argv[2])
