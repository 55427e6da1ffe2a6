"""Damaged checkpoints and a full disk: real orbax checkpoints, really damaged.

A restart whose newest checkpoint has a truncated data file or a deleted
``state/_METADATA`` moves that step aside (``<step>.damaged``), says so in
one line naming the step and the file, and resumes from the step before;
damage only a read can find is moved aside the same way by the read that
fails. A save onto a full filesystem (a small tmpfs, where this machine lets
the test mount one) is one line naming the directory and the bytes, and the
previous checkpoint restores as it was saved.
"""

import glob
import logging
import os
import shutil
import subprocess
import uuid

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jpipe import train as trainer
from jpipe.train.checkpoint import CheckpointError, Checkpoints

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _state(seed: int = 0, leaves: int = 1, size: int = 40_000) -> dict:
    """A small train state spread over conftest's 8 devices, as the trainer's are."""
    mesh = jax.make_mesh((8,), ("x",))
    state = {"step": jnp.asarray(seed, jnp.int32)}
    for i in range(leaves):
        params = jax.random.normal(jax.random.key(seed * 100 + i), (size,), jnp.float32)
        state[f"params{i}"] = jax.device_put(params, NamedSharding(mesh, P("x")))
    return state


def _largest_data_file(directory, step: int) -> str:
    files = glob.glob(
        os.path.join(str(directory), str(step), "state", "**", "d", "*"), recursive=True
    )
    return max(files, key=os.path.getsize)


def _same(a: dict, b: dict) -> bool:
    return all(
        np.array_equal(np.asarray(x), np.asarray(y))
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b))
    )


@pytest.mark.parametrize("damage", ["truncated data file", "deleted _METADATA"])
def test_a_damaged_newest_step_is_moved_aside_and_the_step_before_restores(tmp_path, capfd, damage):
    checkpoints = Checkpoints(tmp_path)
    checkpoints.save(2, _state(2), {"step": 2})
    checkpoints.save(4, _state(4), {"step": 4})
    if damage == "truncated data file":
        path = _largest_data_file(tmp_path, 4)
        size = os.path.getsize(path)
        os.truncate(path, size // 3)
        said = f"{path} is {size // 3} bytes, {size} when saved"
    else:
        path = os.path.join(tmp_path, "4", "state", "_METADATA")
        os.remove(path)
        said = f"{path} is missing"
    checkpoints.close()

    restarted = Checkpoints(tmp_path)  # what a restart does first
    assert restarted.remove_incomplete() == []
    err = capfd.readouterr().err
    aside = os.path.join(tmp_path, "4.damaged")
    assert f"checkpoint of step 4 is damaged: {said}; moved it aside to {aside}\n" in err, err
    assert restarted.latest_step() == 2
    assert os.path.isdir(aside) and os.listdir(os.path.join(aside, "state"))  # kept, not deleted
    assert _same(restarted.restore(2, _state()), _state(2))

    # The run goes on: step 4 is saved again, and damaged again it goes beside the first.
    restarted.save(4, _state(4), {"step": 4})
    os.remove(os.path.join(tmp_path, "4", "state", "_METADATA"))
    assert restarted.set_aside_damaged() == [4]
    assert sorted(os.listdir(tmp_path)) == ["2", "4.damaged", "4.damaged-2"]
    restarted.close()


def test_damage_that_only_a_read_finds_moves_the_step_aside_in_one_line(tmp_path):
    # A step without jpipe's record of its files (saved by an older jpipe, or
    # killed before the record was written): only orbax's read sees the damage.
    checkpoints = Checkpoints(tmp_path)
    checkpoints.save(2, _state(2), {"step": 2})
    checkpoints.save(4, _state(4), {"step": 4})
    os.remove(os.path.join(tmp_path, "4", "jpipe_files.json"))
    os.truncate(_largest_data_file(tmp_path, 4), 100)
    assert checkpoints.set_aside_damaged() == []  # the sizes cannot tell
    with pytest.raises(CheckpointError) as raised:
        checkpoints.restore(4, _state())
    message = str(raised.value)
    assert "\n" not in message
    assert message.startswith(
        f"the checkpoint of step 4 in {tmp_path} cannot be restored (OUT_OF_RANGE: Error reading"
    )
    assert f"moved it aside to {tmp_path}/4.damaged; run again to resume from step 2" in message
    assert checkpoints.latest_step() == 2
    assert _same(checkpoints.restore(2, _state()), _state(2))
    checkpoints.close()


def test_a_state_of_another_structure_is_not_taken_for_damage(tmp_path):
    checkpoints = Checkpoints(tmp_path)
    checkpoints.save(2, _state(2), {"step": 2})
    other = {**_state(), "extra": jnp.zeros(3)}
    with pytest.raises(CheckpointError, match=r"cannot be restored onto this run's state .*mv "):
        checkpoints.restore(2, other)
    assert checkpoints.latest_step() == 2  # left where it was
    checkpoints.close()


# Six arrays, as a train state has several: orbax then writes them from several
# threads, and each thread logs its own traceback of the full disk.
SIX_LEAVES = {"leaves": 6, "size": 12_000}


@pytest.fixture
def small_filesystem(tmp_path):
    """A 500 KiB tmpfs: room for one checkpoint of `SIX_LEAVES`, not two (skips if not allowed)."""
    mount = tmp_path / f"full-{uuid.uuid4().hex[:8]}"
    mount.mkdir()
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("mounting a small tmpfs needs root and mount(8); the full disk is not tested")
    made = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=500k", "tmpfs", str(mount)],
        capture_output=True,
        text=True,
    )
    if made.returncode != 0:
        pytest.skip(f"this machine does not allow mounting a tmpfs ({made.stderr.strip()})")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def test_a_save_onto_a_full_disk_is_one_line_and_the_previous_checkpoint_stays(
    small_filesystem, capfd, caplog
):
    directory = small_filesystem / "checkpoints"
    checkpoints = Checkpoints(directory)
    checkpoints.save(2, _state(2, **SIX_LEAVES), {"step": 2})
    with pytest.raises(CheckpointError) as raised:
        checkpoints.save(4, _state(4, **SIX_LEAVES), {"step": 4})
    message = str(raised.value)
    assert "\n" not in message
    assert message.startswith(
        f"cannot save the checkpoint of step 4 in {directory}: no space left on the device "
        "(it needs about "
    )
    assert "the checkpoint of step 2 is intact" in message
    assert "Traceback" not in capfd.readouterr().err
    # orbax's writer threads each log the failure's traceback: held back and dropped
    assert [r.getMessage()[:200] for r in caplog.records if r.levelno >= logging.ERROR] == []
    assert os.listdir(directory) == ["2"]  # the unfinished step is gone, its space free again
    assert checkpoints.damage(2) is None
    assert _same(checkpoints.restore(2, _state(**SIX_LEAVES)), _state(2, **SIX_LEAVES))
    checkpoints.close()


def _config(steps: int):
    config = trainer.config_from_file(os.path.join(ROOT, "configs", "default.py"))
    for key, value in {
        "steps": steps, "checkpoint_every": 2, "eval_every": 0, "eval_batches": 1, "log_every": 1,
        "num_microbatches": 2, "batch_size": 4, "mesh.pipe": 2, "mesh.data": 1,
        "data.max_bytes": 32768, "model.seq_len": 16, "model.num_layers": 2, "model.num_heads": 2,
        "model.d_model": 32, "model.d_ff": 64, "optimizer.warmup_steps": 1,
    }.items():  # fmt: skip
        *path, last = key.split(".")
        node = config
        for part in path:
            node = node[part]
        node[last] = value
    return config


@pytest.mark.slow
def test_train_resumes_from_the_step_before_a_damaged_one(tmp_path, capfd):
    first = trainer.train(_config(4), str(tmp_path), progress=False)
    directory = tmp_path / "checkpoints"
    path = _largest_data_file(directory, 4)
    os.truncate(path, os.path.getsize(path) // 2)
    capfd.readouterr()

    again = trainer.train(_config(4), str(tmp_path), progress=False)
    out, err = capfd.readouterr()
    assert f"checkpoint of step 4 is damaged: {path} is " in err
    assert f"moved it aside to {directory}/4.damaged" in err
    assert "resuming from the checkpoint of step 2" in out
    assert again.start_step == 2 and again.final_step == 4
    assert again.losses == {3: first.losses[3], 4: first.losses[4]}  # bit for bit
    assert sorted(os.listdir(directory)) == ["2", "4", "4.damaged"]
