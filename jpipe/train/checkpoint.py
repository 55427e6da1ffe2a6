"""Checkpoints: a train state saved with orbax, restored onto its shardings.

A checkpoint is one directory per step under ``DIR/checkpoints``, written by
`orbax.checkpoint.CheckpointManager` with two items: ``state``, the pytree of
arrays (packed parameters, optimizer state, step counter) exactly as the
devices hold them, and ``meta``, a small JSON record of what produced it (the
parameter layout), checked before anything is restored.

Atomicity. Orbax writes a step into a temporary directory
(``<step>.orbax-checkpoint-tmp-*``) and renames it into place when complete,
so a run killed while writing leaves only the temporary directory, which
`Checkpoints` never reads. On file systems where the rename is not atomic a
step directory may exist without its ``_CHECKPOINT_METADATA`` file (orbax
writes it last, before the rename); such a step counts as incomplete too.
Incomplete steps are removed when a run starts, since orbax would refuse to
save over them later.

Saving is synchronous: `save` returns once the state is on disk, so the next
train step may donate (overwrite) the arrays just saved, and a checkpoint that
`latest_step` reports is whole. Every process calls `save` and `restore`;
orbax decides which process writes what.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil

import jax
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils

from jpipe.train.config import ConfigError
from jpipe.train.prepare import Prepared

_METADATA_FILE = "_CHECKPOINT_METADATA"  # orbax writes it into every complete step


class Checkpoints:
    """The checkpoints of one run directory.

    Args:
      directory: where the step directories live (created if missing).
      max_to_keep: how many of the newest checkpoints to keep.
    """

    def __init__(self, directory: str | os.PathLike, *, max_to_keep: int = 2):
        self.directory = os.path.abspath(os.fspath(directory))
        self._manager = ocp.CheckpointManager(
            self.directory,
            options=ocp.CheckpointManagerOptions(
                max_to_keep=max_to_keep,
                enable_async_checkpointing=False,
                # A killed save leaves a tmp directory: remove it on start.
                cleanup_tmp_directories=True,
            ),
        )

    def _is_complete(self, step: int) -> bool:
        return os.path.isfile(os.path.join(self.directory, str(step), _METADATA_FILE))

    def complete_steps(self) -> list[int]:
        """The steps with a complete checkpoint, oldest first."""
        self._manager.reload()
        return sorted(s for s in self._manager.all_steps() if self._is_complete(s))

    def latest_step(self) -> int | None:
        """The newest complete checkpoint's step, or None when there is none."""
        steps = self.complete_steps()
        return steps[-1] if steps else None

    def remove_incomplete(self) -> list[int]:
        """Deletes step directories that were never finished; returns their steps."""
        self._manager.reload()
        broken = [s for s in self._manager.all_steps() if not self._is_complete(s)]
        if jax.process_index() == 0:
            for s in broken:
                shutil.rmtree(os.path.join(self.directory, str(s)), ignore_errors=True)
        if jax.process_count() > 1:  # nobody reads the directory before it is tidy
            multihost_utils.sync_global_devices("jpipe.checkpoint.remove_incomplete")
        if broken:
            self._manager.reload()
        return broken

    def metadata(self, step: int) -> dict:
        """The ``meta`` record saved with `step`."""
        restored = self._manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))
        return dict(restored.meta)

    def save(self, step: int, state, metadata: dict) -> None:
        """Writes `state` (a pytree of arrays) and `metadata` (JSON) as `step`."""
        self._manager.save(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(metadata)
            ),
            force=True,
        )
        self._manager.wait_until_finished()

    def restore(self, step: int, target):
        """Reads `step` onto the shapes, dtypes and shardings of `target`.

        Args:
          step: a complete checkpoint's step.
          target: a pytree like the saved state, of arrays or
            `jax.ShapeDtypeStruct` with shardings.

        Returns:
          The saved state, with `target`'s tree structure (orbax returns
          NamedTuples as plain tuples; they are rebuilt here).
        """
        abstract = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), target
        )
        restored = self._manager.restore(
            step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract))
        )
        leaves = jax.tree.leaves(restored.state)
        return jax.tree.unflatten(jax.tree.structure(abstract), leaves)

    def close(self) -> None:
        self._manager.close()


# ---------------------------------------------------------------------------
# What a checkpoint must match to be resumed.


def layout_record(prepared: Prepared) -> dict:
    """What fixes the packed layout of the parameters, as JSON: a checkpoint must match it."""
    c = prepared.config
    if dataclasses.is_dataclass(c.model):
        model = dataclasses.asdict(c.model)
        model.pop("dtype", None)  # the compute dtype does not change the parameters
    else:  # a builder's own fields, as JSON can hold them
        model = json.loads(json.dumps(c.model.to_dict(), default=repr))
    if c.model_name != "gpt":  # checkpoints of the GPT stay as they were
        model["name"] = _model_name(c.model_name)
    return {
        "model": model,
        "layers_per_stage": list(prepared.layers_per_stage),
        "stage_to_rank": list(prepared.schedule.stage_to_rank),
        "mesh.pipe": c.mesh.pipe,
    }


def _model_name(name: str) -> str:
    """A builder's name without the directories of its file, which a moved run may change."""
    path, sep, function = name.rpartition(":")
    return f"{os.path.basename(path)}:{function}" if sep and path.endswith(".py") else name


def checkpoint_meta(pipeline, prepared: Prepared) -> dict:
    """The checkpoint's ``meta`` item: the layout record, the buckets, and for people, the rest."""
    return {
        "layout": layout_record(prepared),
        "buckets": {
            name: [list(shape), dtype]
            for name, (shape, dtype) in sorted(pipeline.layout.buckets.items())
        },
        "schedule": prepared.config.schedule,
        "mesh": dataclasses.asdict(prepared.config.mesh),
    }


def check_resumable(checkpoints: Checkpoints, step: int, prepared: Prepared) -> None:
    """Refuses a checkpoint whose parameters were laid out for another model or split."""
    saved = checkpoints.metadata(step).get("layout", {})
    wanted = layout_record(prepared)
    differences = [
        f"{key}: {saved.get(key)!r} in the checkpoint, {wanted[key]!r} now"
        for key in wanted
        if saved.get(key) != wanted[key]
    ]
    if differences:
        raise ConfigError(
            f"the checkpoint of step {step} in {checkpoints.directory} was written for another "
            f"model or pipeline split ({'; '.join(differences)}); resume with that run's config "
            "(config.model, config.layers_per_stage, config.schedule, config.mesh.pipe), or give "
            "a new --workdir"
        )
