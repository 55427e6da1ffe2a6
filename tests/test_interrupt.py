"""Ctrl-C at any moment of a real ``python train.py``: a clear line, exit status 130.

Each test starts ``train.py`` as a subprocess with SIGINT's default meaning
(as tests/test_train.py's resume test does), waits for a phase it can see
(the "compiling the train step ..." line, an orbax temporary directory) and
sends a real SIGINT. What must never show: "Fatal Python error" (a crash
inside XLA when a KeyboardInterrupt was raised in the middle of its work),
"Exception ignored" (a KeyboardInterrupt swallowed by a callback JAX runs,
after which the run went on to the end and exited 0) or a traceback.
"""

import importlib.util
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from jpipe.train.checkpoint import Checkpoints

pytestmark = pytest.mark.slow  # each test trains, most in a train.py process

ROOT = Path(__file__).resolve().parents[1]

TINY = [
    "--config.mesh.pipe=2",
    "--config.mesh.data=1",
    "--config.num_microbatches=2",
    "--config.batch_size=4",
    "--config.log_every=1",
    "--config.eval_every=100",
    "--config.eval_batches=1",
    "--config.data.max_bytes=32768",
    "--config.model.seq_len=16",
    "--config.model.num_layers=2",
    "--config.model.d_model=32",
    "--config.model.d_ff=64",
]


def _start(workdir, *flags) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    command = [sys.executable, str(ROOT / "train.py"), f"--workdir={workdir}", *TINY, *flags]
    # The child gets Ctrl-C's default meaning even where pytest runs in the background
    # (a shell's `&` ignores SIGINT, and a child inherits an ignored signal).
    previous = signal.signal(signal.SIGINT, signal.SIG_DFL)
    try:
        return subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
        )
    finally:
        signal.signal(signal.SIGINT, previous)


def _wait_for_line(run: subprocess.Popen, text: str, seen: list[str]) -> None:
    """Reads the child's output until a line holding `text` (kept in `seen`)."""
    for line in run.stdout:
        seen.append(line)
        if text in line:
            return
    raise AssertionError(f"{text!r} never showed:\n{''.join(seen)}\n{run.stderr.read()[-3000:]}")


def _assert_clean(out: str, err: str) -> None:
    for bad in ("Fatal Python error", "Exception ignored", "Traceback", "Segmentation fault"):
        assert bad not in out + err, (out + err)[-4000:]


def test_ctrl_c_while_compiling_stops_cleanly(tmp_path):
    """One Ctrl-C while XLA compiles: the compile ends, then a clear line and status 130."""
    run = _start(tmp_path / "run", "--config.steps=40")
    seen: list[str] = []
    _wait_for_line(run, "compiling the train step ...", seen)
    run.send_signal(signal.SIGINT)  # compiling takes seconds; this lands inside it
    out, err = run.communicate(timeout=240)
    out = "".join(seen) + out
    assert run.returncode == 130, (out + err)[-4000:]
    _assert_clean(out, err)
    assert "Ctrl-C: stopping once compiling the train step ends" in out, out[-2000:]
    last = out.strip().splitlines()[-1]
    assert last.startswith("interrupted before the first step; nothing was saved; start with: ")
    assert str(tmp_path / "run") in last  # the command to run again
    # Stopped before anything was trained, evaluated or written.
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
    assert Checkpoints(tmp_path / "run" / "checkpoints").latest_step() is None


def test_second_ctrl_c_while_compiling_stops_at_once(tmp_path):
    """Two Ctrl-Cs while compiling: the process ends at once, status 130, no crash."""
    run = _start(tmp_path / "run", "--config.steps=40")
    seen: list[str] = []
    _wait_for_line(run, "compiling the train step ...", seen)
    run.send_signal(signal.SIGINT)
    _wait_for_line(run, "Ctrl-C: stopping once compiling the train step ends", seen)
    run.send_signal(signal.SIGINT)
    out, err = run.communicate(timeout=120)
    out = "".join(seen) + out
    assert run.returncode == 130, (out + err)[-4000:]
    _assert_clean(out, err)
    assert "Ctrl-C again: stopping now, without saving" in out, out[-2000:]
    assert "held-out loss" not in out  # nothing ran after it


def test_ctrl_c_during_a_checkpoint_save_stops_after_it(tmp_path):
    """Ctrl-C while orbax writes a checkpoint: the save completes, then the run stops.

    Every step saves (``checkpoint_every=1``), so most of the loop's time is
    spent saving, and the signal goes the moment a step's temporary
    directory appears; wherever it lands, the same must hold.
    """
    workdir = tmp_path / "run"
    run = _start(workdir, "--config.steps=40", "--config.checkpoint_every=1")
    directory = workdir / "checkpoints"
    deadline = time.monotonic() + 240
    while True:
        assert run.poll() is None and time.monotonic() < deadline, run.communicate()
        names = os.listdir(directory) if directory.is_dir() else []
        writing = [n for n in names if "orbax-checkpoint-tmp" in n]
        if writing and not writing[0].startswith("1."):  # past the first step's save
            break
        time.sleep(0.001)
    run.send_signal(signal.SIGINT)
    out, err = run.communicate(timeout=120)
    assert run.returncode == 130, (out + err)[-4000:]
    _assert_clean(out, err)
    last = out.strip().splitlines()[-1]
    assert last.startswith("interrupted at step "), out[-2000:]
    step = int(last.split()[3].rstrip(","))
    assert 2 <= step < 40
    # The checkpoint the line names is whole, and nothing half-written is left.
    assert Checkpoints(directory).latest_step() == step
    assert not [n for n in os.listdir(directory) if "tmp" in n]


def test_ctrl_c_while_the_last_checkpoint_is_written_is_answered(tmp_path, monkeypatch):
    """Ctrl-C after the last step, while `train` waits for its checkpoint's writes.

    In process (the window is too short to hit from outside): the closing of
    the checkpoints sends this process a real SIGINT first, as a user's
    Ctrl-C landing there would. `train` must not return as if nothing came:
    it raises `Interrupted`, saying the run is complete and its last step's
    checkpoint is whole, which ``train.py`` turns into a line and status 130.
    """
    from jpipe import train as trainer

    close = Checkpoints.close

    def close_after_a_ctrl_c(self):
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.2)  # the handler runs in the main thread between bytecodes
        close(self)

    monkeypatch.setattr(Checkpoints, "close", close_after_a_ctrl_c)
    # The trainer answers Ctrl-C only where SIGINT has Python's own meaning.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        config = _tiny_config()
        try:
            trainer.train(config, str(tmp_path), progress=False)
        except trainer.Interrupted as e:
            interrupted = e
        else:
            raise AssertionError("train returned as if no Ctrl-C came")
    finally:
        signal.signal(signal.SIGINT, previous)
    assert interrupted.finished and interrupted.saved and interrupted.step == 4
    assert "the run is complete" in str(interrupted)
    assert Checkpoints(tmp_path / "checkpoints").latest_step() == 4


def _tiny_config():
    """configs/default.py as TINY shrinks it, 4 steps, a checkpoint every 2."""
    spec = importlib.util.spec_from_file_location("default_config", ROOT / "configs" / "default.py")
    default = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(default)
    config = default.get_config()
    for flag in TINY + ["--config.steps=4", "--config.checkpoint_every=2"]:
        key, value = flag.removeprefix("--config.").split("=")
        *path, last = key.split(".")
        node = config
        for part in path:
            node = node[part]
        node[last] = type(node[last])(value)
    return config
