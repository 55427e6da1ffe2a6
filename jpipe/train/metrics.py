"""Metrics: ``metrics.jsonl``, TensorBoard and the terminal, from process 0 only."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from typing import NamedTuple

import jax


class Metrics:
    """Writes records to ``metrics.jsonl`` and TensorBoard, on process 0 only."""

    def __init__(self, workdir: str, resume_step: int, enabled: bool):
        self.enabled = enabled
        self.path = os.path.join(workdir, "metrics.jsonl")
        self.tensorboard = None
        self.tensorboard_name = None
        if not enabled:
            return
        _truncate_metrics(self.path, resume_step)
        self.tensorboard, self.tensorboard_name = _tensorboard_writer(
            os.path.join(workdir, "tensorboard")
        )

    def write(self, record: dict) -> None:
        if not self.enabled:
            return
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
        if self.tensorboard is not None:
            step = record["step"]
            for key, value in record.items():
                if key != "step" and isinstance(value, float):
                    self.tensorboard.scalar(key, value, step)
            self.tensorboard.flush()

    def close(self) -> None:
        if self.tensorboard is not None:
            self.tensorboard.close()


def _truncate_metrics(path: str, last_step: int) -> None:
    """Drops records past `last_step`: a resumed run writes those steps again."""
    if not os.path.exists(path):
        return
    with open(path) as f:
        lines = f.readlines()
    kept = []
    for line in lines:
        try:
            if json.loads(line)["step"] <= last_step:
                kept.append(line if line.endswith("\n") else line + "\n")
        except (ValueError, KeyError, TypeError):
            continue  # a line cut short by a kill
    if len(kept) != len(lines):
        with open(path + ".tmp", "w") as f:
            f.writelines(kept)
        os.replace(path + ".tmp", path)


class _ScalarWriter(NamedTuple):
    """The three calls `_Metrics` makes of a TensorBoard writer."""

    scalar: Callable  # (name, value, step)
    flush: Callable
    close: Callable


def _tensorboard_writer(logdir: str) -> tuple[_ScalarWriter | None, str | None]:
    """A writer and its library's name, or ``(None, None)`` when neither is installed.

    tensorboardX is one of jpipe's dependencies, so this is TensorBoard files
    by default; an install without it (and without TensorFlow) says so once.
    """
    try:
        from tensorboardX import SummaryWriter  # noqa: PLC0415 (a dependency)
    except ImportError:
        try:
            from flax.metrics.tensorboard import SummaryWriter  # noqa: PLC0415 (needs TensorFlow)
        except ImportError:
            say("TensorBoard files off: neither tensorboardX nor TensorFlow is installed")
            return None, None
        writer = SummaryWriter(logdir)
        return _ScalarWriter(writer.scalar, writer.flush, writer.close), "TensorFlow"
    writer = SummaryWriter(logdir)
    return _ScalarWriter(writer.add_scalar, writer.flush, writer.close), "tensorboardX"


def say(text: str = "") -> None:
    if jax.process_index() == 0:
        print(text, flush=True)


def mib(n: float) -> str:
    return f"{n / 2**20:,.1f} MiB"
