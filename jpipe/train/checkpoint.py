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

Arrays that live on one process. With a mesh per rank in a run of several
processes, a rank's state lives on one process's devices, which orbax's array
handler refuses; such arrays are saved as a third item, ``local``
(`jpipe.train.process_arrays`: each process writes those it holds, by name),
the rest as ``state`` by name too, and ``meta`` records which items the step
holds (``items``), so `restore` and `damage` know what to read and check.

Saving is synchronous: `save` returns once the state is on disk, so the next
train step may donate (overwrite) the arrays just saved, and a checkpoint that
`latest_step` reports is whole. Every process calls `save` and `restore`;
orbax decides which process writes what.

Damage. A complete step can still be damaged later (a data file truncated by
a full disk or a bad copy, a file deleted), and orbax then fails deep inside
TensorStore naming neither the step nor the file. So once a save has
finished, process 0 records every file of the step with its size
(``<step>/jpipe_files.json``); at the start of a run (`remove_incomplete`)
the newest steps are checked against their record (a `stat` per file, no
data read) and for orbax's own metadata files, and a damaged one is moved
aside, never deleted, to ``<step>.damaged`` beside it (orbax ignores the
name), with one line naming the step, the file and the new name; the run
then resumes from the newest step that passes. Damage the sizes cannot see
(a file overwritten in place) still fails in `restore` or `metadata`: that
step is moved aside the same way and `CheckpointError` says so in one line,
so the next start resumes from the step before. A save that fails for lack
of space is one line too, naming the directory and the bytes it needed; the
previous checkpoints are untouched (orbax writes into a temporary directory
and deletes old steps only after a save succeeds).
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import functools
import gc
import json
import logging
import os
import re
import shutil
import sys
import time

import jax
import numpy as np
import orbax.checkpoint as ocp
from etils import epath

from jpipe.runtime.distributed import from_process_zero
from jpipe.train import process_arrays
from jpipe.train.config import ConfigError
from jpipe.train.prepare import Prepared

_METADATA_FILE = "_CHECKPOINT_METADATA"  # orbax writes it into every complete step
# What every complete step of this trainer holds, besides `_METADATA_FILE`: the `meta`
# record, and as its ``items`` say, orbax's metadata of the state (without it the arrays
# cannot be read) and each process's list of the arrays it wrote itself (`process_arrays`).
_REQUIRED_FILES = ("meta/metadata",)
_STATE_INDEX = "state/_METADATA"
FILES_RECORD = "jpipe_files.json"  # written by `save`: each file of the step and its size
DAMAGED_SUFFIX = ".damaged"
# How an error says the disk is full, where it is not an OSError (TensorStore's are not).
_NO_SPACE_WORDS = ("no space left", "disk quota exceeded", "resource_exhausted")
# How TensorStore and orbax say a file is short, missing or garbled (TensorStore's
# status codes, as its errors print them).
_DAMAGE_WORDS = (
    "out_of_range", "data_loss", "error reading", "not_found", "no such file", "corrupt",
    "checksum", "truncated", "unexpected end", "failed to decode", "expecting value",
)  # fmt: skip


class CheckpointError(ConfigError):
    """A checkpoint that cannot be restored or saved, said in one line.

    A `ConfigError`, so that callers that print those in one line (``train.py``)
    print these so too.
    """


def _say(text: str) -> None:
    if jax.process_index() == 0:
        print(text, file=sys.stderr, flush=True)


def _first_line(error: BaseException) -> str:
    """The line of `error` that says what failed.

    Orbax wraps TensorStore's error (``OUT_OF_RANGE: Error reading "params/0"
    in OCDBT database at local file ...``) in one that prints a page of
    TensorStore's spec: the line with a status code, anywhere in the chain,
    is the one to show.
    """
    seen, chain = set(), []
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        chain.append(error)
        error = error.__cause__ or error.__context__
    for e in chain:
        for line in str(e).splitlines():
            if re.match(r"[A-Z][A-Z_]+: ", line.strip()):
                return line.strip()[:400]
    text = str(chain[0]).strip()
    return text.splitlines()[0][:400] if text else type(chain[0]).__name__


class Checkpoints:
    """The checkpoints of one run directory.

    Args:
      directory: where the step directories live (created if missing).
      max_to_keep: how many of the newest checkpoints to keep.
    """

    def __init__(self, directory: str | os.PathLike, *, max_to_keep: int = 2):
        self.directory = os.path.abspath(os.fspath(directory))
        problem = ""
        if jax.process_index() == 0:
            try:
                os.makedirs(self.directory, exist_ok=True)
            except OSError as e:
                problem = e.strerror or str(e)
        # The others wait until it exists, and fail alike when it cannot be made.
        problem = from_process_zero("checkpoint.directory", problem)
        if problem:
            raise CheckpointError(
                f"cannot create the checkpoint directory {self.directory} ({problem})"
            )
        self._manager = ocp.CheckpointManager(
            self.directory,
            options=ocp.CheckpointManagerOptions(
                max_to_keep=max_to_keep,
                enable_async_checkpointing=False,
                # A killed save leaves a tmp directory: remove it on start.
                cleanup_tmp_directories=True,
                create=False,  # made above: orbax will not with `active_processes`
                # Naming the processes makes orbax wait for them through the coordination
                # service, not `multihost_utils.sync_global_devices`, whose collective
                # fails where processes hold different numbers of devices.
                multiprocessing_options=ocp.options.MultiprocessingOptions(
                    active_processes=set(range(jax.process_count()))
                    if jax.process_count() > 1
                    else None
                ),
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
        """Deletes step directories that were never finished; returns their steps.

        Then moves the newest complete steps that are damaged aside
        (`set_aside_damaged`), so that `latest_step` is the newest that passes.
        """
        self._manager.reload()
        broken = [s for s in self._manager.all_steps() if not self._is_complete(s)]
        if jax.process_index() == 0:
            for s in broken:
                shutil.rmtree(os.path.join(self.directory, str(s)), ignore_errors=True)
            self.set_aside_damaged()
        if jax.process_count() > 1:  # nobody reads the directory before it is tidy
            from_process_zero("checkpoint.remove_incomplete", "")
        self._manager.reload()
        return broken

    def damage(self, step: int) -> str | None:
        """What is wrong with complete step `step`'s files, or None when nothing is seen.

        Checks orbax's metadata files are there and readable and, where
        `save` recorded them, that every file has the size it was saved with.
        Reads no array data.
        """
        root = os.path.join(self.directory, str(step))
        for name in _REQUIRED_FILES:
            path = os.path.join(root, name)
            if not os.path.isfile(path):
                return f"{path} is missing"
        try:
            with open(os.path.join(root, "meta", "metadata")) as f:
                items = _items(json.load(f))
        except (OSError, ValueError) as e:
            return f"{os.path.join(root, 'meta', 'metadata')} cannot be read ({_first_line(e)})"
        if "state" in items:
            if not os.path.isfile(os.path.join(root, _STATE_INDEX)):
                return f"{os.path.join(root, _STATE_INDEX)} is missing"
            try:
                with open(os.path.join(root, _STATE_INDEX)) as f:
                    json.load(f)
            except (OSError, ValueError) as e:
                return f"{os.path.join(root, _STATE_INDEX)} cannot be read ({_first_line(e)})"
        if "local" in items:
            missing = process_arrays.missing_files(os.path.join(root, "local"), items["local"])
            if missing is not None:
                return missing
        try:
            with open(os.path.join(root, FILES_RECORD)) as f:
                sizes = json.load(f)
        except FileNotFoundError:
            return None  # saved before this record existed, or killed before writing it
        except (OSError, ValueError):
            return None  # the record itself is damaged: it vouches for nothing
        for name, size in sorted(sizes.items()):
            path = os.path.join(root, name)
            try:
                now = os.path.getsize(path)
            except OSError:
                return f"{path} is missing"
            if now != size:
                return f"{path} is {now} bytes, {size} when saved"
        return None

    def set_aside(self, step: int, reason: str) -> str:
        """Renames step `step` to ``<step>.damaged`` (``.damaged-2``, ... if taken); says so.

        Returns:
          The new path.
        """
        old = os.path.join(self.directory, str(step))
        new = old + DAMAGED_SUFFIX
        n = 1
        while os.path.exists(new):
            n += 1
            new = f"{old}{DAMAGED_SUFFIX}-{n}"
        os.rename(old, new)
        _say(f"checkpoint of step {step} is damaged: {reason}; moved it aside to {new}")
        return new

    def set_aside_damaged(self) -> list[int]:
        """Moves the newest complete steps aside while they are damaged; returns their steps.

        Stops at the first step that passes `damage`: older steps are not
        read (a run resumes from the newest).
        """
        self._manager.reload()
        moved = []
        for step in reversed([s for s in self._manager.all_steps() if self._is_complete(s)]):
            reason = self.damage(step)
            if reason is None:
                break
            self.set_aside(step, reason)
            moved.append(step)
        if moved:
            self._manager.reload()
        return moved

    def _unreadable(self, step: int, error: BaseException) -> CheckpointError:
        """The error of a failed read of `step`; moves the step aside if its files are damaged.

        A failure that does not look like damaged files (a state of another
        structure: an optimizer changed since) leaves the step where it is.
        """
        _collect_quietly()
        where = f"the checkpoint of step {step} in {self.directory}"
        # A step whose recorded files are all there at their saved sizes is whole: a
        # failed read of it is a mismatch with this run's state (an optimizer changed),
        # however orbax words it, and it stays where it is.
        vouched = self.damage(step) is None and os.path.isfile(
            os.path.join(self.directory, str(step), FILES_RECORD)
        )
        if vouched or not _says_damaged(error):
            return CheckpointError(
                f"{where} cannot be restored onto this run's state ({_first_line(error)}); "
                "resume with the config that wrote it, give a new --workdir, or if its files "
                f"are damaged move it aside (mv {self.directory}/{step} "
                f"{self.directory}/{step}{DAMAGED_SUFFIX}) to resume from the step before"
            )
        try:
            moved = self.set_aside(step, f"orbax cannot read it ({_first_line(error)})")
        except OSError:  # another process moved it first
            moved = os.path.join(self.directory, f"{step}{DAMAGED_SUFFIX}")
        self._manager.reload()
        older = self.latest_step()
        then = (
            f"run again to resume from step {older}"
            if older is not None
            else "no older checkpoint is left; run again to start from step 0"
        )
        return CheckpointError(
            f"{where} cannot be restored ({_first_line(error)}); moved it aside to {moved}; {then}"
        )

    def metadata(self, step: int) -> dict:
        """The ``meta`` record saved with `step`."""
        try:
            restored = self._manager.restore(
                step, args=ocp.args.Composite(meta=ocp.args.JsonRestore())
            )
        except Exception as e:  # noqa: BLE001 (any failure to read is said in one line)
            raise self._unreadable(step, e) from None
        return dict(restored.meta)

    def save(self, step: int, state, metadata: dict) -> None:
        """Writes `state` (a pytree of arrays) and `metadata` (JSON) as `step`.

        Raises:
          CheckpointError: the disk is full (one line: the directory, the bytes
            the checkpoint needs and those free); the previous checkpoints are
            untouched and the unfinished one is removed.
        """
        on_all, held_whole = _split(state)
        items = {}
        if held_whole:  # arrays each on one process: each process writes its own
            metadata = {**metadata, "items": {"local": jax.process_count()}}
            if on_all:
                metadata["items"]["state"] = True
                items["state"] = ocp.args.StandardSave(on_all)
            items["local"] = process_arrays.ProcessArraysSave(held_whole)
        else:
            items["state"] = ocp.args.StandardSave(state)
        items["meta"] = ocp.args.JsonSave(metadata)
        held = _HeldErrorLogs()
        try:
            self._manager.save(step, args=ocp.args.Composite(**items), force=True)
            self._manager.wait_until_finished()
        except Exception as e:  # noqa: BLE001 (only a full disk is turned into one line)
            if not _says_no_space(e):
                held.release()
                raise
            held.drop()
            _collect_quietly()
            raise self._no_space(step, state) from None
        held.release()
        if jax.process_index() == 0:
            self._record_files(step)

    def _record_files(self, step: int) -> None:
        """Writes `FILES_RECORD` into finished step `step`: its files and their sizes."""
        root = os.path.join(self.directory, str(step))
        sizes = {}
        for folder, _, names in os.walk(root):
            for name in names:
                path = os.path.join(folder, name)
                sizes[os.path.relpath(path, root)] = os.path.getsize(path)
        sizes.pop(FILES_RECORD, None)
        temporary = os.path.join(root, FILES_RECORD + ".tmp")
        try:
            with open(temporary, "w") as f:
                json.dump(sizes, f, sort_keys=True)
            os.replace(temporary, os.path.join(root, FILES_RECORD))
        except OSError:  # no room for the record: the step is whole, only unvouched for
            with contextlib.suppress(OSError):
                os.remove(temporary)

    def _no_space(self, step: int, state) -> CheckpointError:
        """The one-line error of a save that ran out of space; removes what it left."""
        if jax.process_index() == 0:
            for name in os.listdir(self.directory):
                if name.startswith(f"{step}.orbax-checkpoint-tmp"):
                    _remove(os.path.join(self.directory, name))
        # The arrays' bytes, or what the last checkpoint takes on this disk if more
        # (orbax's metadata, the filesystem's blocks).
        needed = sum(x.nbytes for x in jax.tree.leaves(state) if hasattr(x, "nbytes"))
        previous = self.latest_step()
        if previous is not None:
            needed = max(needed, _disk_bytes(os.path.join(self.directory, str(previous))))
        try:
            free = f", {shutil.disk_usage(self.directory).free:,} free"
        except OSError:
            free = ""
        kept = (
            f"the checkpoint of step {previous} is intact"
            if previous is not None
            else "no earlier checkpoint exists"
        )
        return CheckpointError(
            f"cannot save the checkpoint of step {step} in {self.directory}: no space left on the "
            f"device (it needs about {needed:,} bytes{free}); {kept}; free some space, or give "
            "another --workdir, and run again"
        )

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
        structure = jax.tree.structure(abstract)
        items = _items(self.metadata(step))
        try:
            if "local" not in items:
                if any(map(process_arrays.held_by_one_process, jax.tree.leaves(abstract))):
                    return jax.tree.unflatten(structure, self._into_processes(step, abstract))
                restored = self._manager.restore(
                    step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract))
                )
                return jax.tree.unflatten(structure, jax.tree.leaves(restored.state))
            # Saved by several processes: read each array where it was written (by name),
            # whichever process holds it now.
            local = os.path.join(self.directory, str(step), "local")
            written = process_arrays.ProcessArraysHandler().metadata(local)
            named = _named(abstract)
            args = {
                "local": process_arrays.ProcessArraysRestore(
                    {n: t for n, t in named.items() if n in written}
                )
            }
            on_all = {n: t for n, t in named.items() if n not in written}
            if on_all:
                args["state"] = ocp.args.StandardRestore(on_all)
            restored = self._manager.restore(step, args=ocp.args.Composite(**args))
        except Exception as e:  # noqa: BLE001 (any failure to read is said in one line)
            raise self._unreadable(step, e) from None
        found = dict(restored.local)
        if on_all:
            found.update(restored.state)
        return jax.tree.unflatten(structure, [found[n] for n in named])

    def _into_processes(self, step: int, abstract) -> list:
        """The leaves of a step saved as global arrays (by one process, or on one mesh) for a
        state whose arrays now each live on one process of several (a run resumed in more
        processes): each process reads the arrays it holds onto its host and places them,
        skipping the others' (orbax's `PLACEHOLDER`: arrays this process's state holds
        with no shards here, or not at all); the global ones as orbax reads them.

        The request follows the saved tree (orbax keeps a NamedTuple as a dict of its
        fields), its leaves matched to the state's by name."""
        path = epath.Path(self.directory) / str(step) / "state"
        saved = ocp.StandardCheckpointHandler().metadata(path).tree
        named = _named(abstract)
        key = functools.partial(jax.tree_util.keystr, simple=True, separator=".")

        def skipped(t) -> bool:  # another process's rank: not in this state, or not here
            if t is None:
                return True
            return process_arrays.held_by_one_process(t) and not process_arrays.is_mine(t)

        def item(p, _):
            t = named.get(key(p))
            return ocp.PLACEHOLDER if skipped(t) else t

        def how(p, _):
            t = named.get(key(p))
            if skipped(t):
                return ocp.PLACEHOLDER
            if not process_arrays.held_by_one_process(t):
                return ocp.ArrayRestoreArgs(sharding=t.sharding)
            return ocp.RestoreArgs(restore_type=np.ndarray, dtype=t.dtype)

        # A checkpointer of its own: through the manager, the item would stay bound to the
        # PyTree handler, and the manager's next save of it (a StandardSave) be refused. Its
        # barrier through the coordination service, as the manager's (`__init__`).
        processes = ocp.options.MultiprocessingOptions(
            active_processes=set(range(jax.process_count()))
        )
        handler = ocp.PyTreeCheckpointHandler(multiprocessing_options=processes)
        with ocp.Checkpointer(handler, multiprocessing_options=processes) as reader:
            restored = reader.restore(
                path,
                args=ocp.args.PyTreeRestore(
                    item=jax.tree_util.tree_map_with_path(item, saved),
                    restore_args=jax.tree_util.tree_map_with_path(how, saved),
                ),
            )
        found = {key(p): v for p, v in jax.tree_util.tree_leaves_with_path(restored)}
        out = []
        for name, t in named.items():
            if not process_arrays.held_by_one_process(t):
                out.append(found[name])
            elif process_arrays.is_mine(t):
                out.append(jax.device_put(np.asarray(found[name]), t.sharding))
            else:
                out.append(process_arrays.held_elsewhere(t))
        return out

    def close(self) -> None:
        self._manager.close()


def _remove(folder: str, seconds: float = 10.0) -> None:
    """Removes `folder`, again while orbax's writer threads of a failed save still add to
    it (one pass can leave it: a file written during the walk keeps a folder from going,
    seen under load in tests/test_checkpoint_damage.py); gives up after `seconds`."""
    deadline = time.monotonic() + seconds
    shutil.rmtree(folder, ignore_errors=True)
    while os.path.exists(folder) and time.monotonic() < deadline:
        time.sleep(0.05)
        shutil.rmtree(folder, ignore_errors=True)


def _named(tree) -> dict:
    """`tree`'s leaves by their place in it (``params.1.float32``), in its order."""
    leaves = jax.tree_util.tree_leaves_with_path(tree)
    named = {jax.tree_util.keystr(path, simple=True, separator="."): leaf for path, leaf in leaves}
    if len(named) != len(leaves):  # two leaves of one name: one would not be saved
        raise ValueError(f"the state has {len(leaves)} leaves but {len(named)} distinct names")
    return named


def _split(state) -> tuple[dict, dict]:
    """`state`'s leaves by name: those saved by orbax as global arrays, and those each
    held by one process of several (`process_arrays.held_by_one_process`)."""
    on_all, held_whole = {}, {}
    for name, leaf in _named(state).items():
        (held_whole if process_arrays.held_by_one_process(leaf) else on_all)[name] = leaf
    return on_all, held_whole


def _items(meta: dict) -> dict:
    """The items a step holds, from its ``meta`` record: ``{"state": True}`` (orbax's global
    arrays), and ``"local": processes`` where that many processes wrote their own arrays."""
    return meta.get("items") or {"state": True}


class _HeldErrorLogs(logging.Filter):
    """Holds back the errors orbax logs while a save runs, until it is known how it ended.

    Each of orbax's writer threads logs its own traceback of the same failure
    (a full disk gave 3 tracebacks and 144 lines before the one that
    matters). A save that fails for lack of space drops them, its one line
    saying it all; any other ending logs them as they came.
    """

    def __init__(self):
        super().__init__()
        self.records: list[logging.LogRecord] = []
        self._logger = logging.getLogger("absl")  # absl.logging's, which orbax uses
        self._logger.addFilter(self)

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno >= logging.ERROR and f"{os.sep}orbax{os.sep}" in record.pathname:
            self.records.append(record)
            return False
        return True

    def drop(self) -> None:
        self._logger.removeFilter(self)
        self.records.clear()

    def release(self) -> None:
        self._logger.removeFilter(self)
        for record in self.records:
            self._logger.handle(record)
        self.records.clear()


def _collect_quietly() -> None:
    """Collects, without a word, what a failed orbax read left behind.

    Orbax's reads of the other shards stay behind as coroutines (and an event
    loop) that print their own copy of the error when the garbage collector
    finds them: a page of TensorStore specs after the one line that matters.
    """
    hook = sys.unraisablehook
    sys.unraisablehook = lambda unraisable: None
    try:
        gc.collect()
    finally:
        sys.unraisablehook = hook


def _disk_bytes(root: str) -> int:
    """The bytes the files under `root` take on their disk (their blocks, where known)."""
    total = 0
    for folder, _, names in os.walk(root):
        for name in names:
            try:
                info = os.stat(os.path.join(folder, name))
            except OSError:
                continue
            total += max(info.st_size, getattr(info, "st_blocks", 0) * 512)
    return total


def _says_damaged(error: BaseException) -> bool:
    """Whether a failed read of a checkpoint (or an error it came from) is its files' fault."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, (FileNotFoundError, json.JSONDecodeError, EOFError)):
            return True
        if any(word in str(error).lower() for word in _DAMAGE_WORDS):
            return True
        error = error.__cause__ or error.__context__
    return False


def _says_no_space(error: BaseException) -> bool:
    """Whether `error` (or one it came from) is a full disk or quota."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if any(word in str(error).lower() for word in _NO_SPACE_WORDS):
            return True
        error = error.__cause__ or error.__context__
    return False


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
        # Each rank's arrays on its own mesh (``params.<rank>.<bucket>``, one row), or every
        # rank's rows of each bucket on one mesh (``params.<bucket>``).
        "params_per_rank": prepared.config.rank_tensors is not None,
        "model_name": prepared.config.model_name,  # the builder's full path, for load_params
        # The optimizer's state has its own structure: resuming under another is refused.
        "optimizer": prepared.config.optimizer.name,
    }


def check_resumable(checkpoints: Checkpoints, step: int, prepared: Prepared) -> None:
    """Refuses a checkpoint whose parameters were laid out for another model or split."""
    meta = checkpoints.metadata(step)
    saved = meta.get("layout", {})
    wanted = layout_record(prepared)
    differences = [
        f"{key}: {saved.get(key)!r} in the checkpoint, {wanted[key]!r} now"
        for key in wanted
        if saved.get(key) != wanted[key]
    ]
    # Recorded since the per-rank lowering gave each rank a mesh by default; before, only
    # mesh.tensor_per_rank did.
    saved_per_rank = meta.get("params_per_rank", bool(meta.get("mesh", {}).get("tensor_per_rank")))
    per_rank = prepared.config.rank_tensors is not None
    if saved_per_rank != per_rank:
        how = {True: "each rank's on a mesh of its own", False: "every rank's on one mesh"}
        resume = (
            "--config.lowering=mpmd (without mesh.pipe_hosts or mesh.data_hosts)"
            if saved_per_rank
            else "--config.lowering=spmd, which keeps them on one mesh"
        )
        raise ConfigError(
            f"the checkpoint of step {step} in {checkpoints.directory} holds the parameters and "
            f"optimizer state {how[saved_per_rank]}, and this run lays them out "
            f"{how[per_rank]} (the per-rank lowering gives each rank a mesh of its own, "
            "unless mesh.pipe_hosts or mesh.data_hosts lays one mesh across hosts); resume "
            f"with {resume}, or start from its weights in a new --workdir with "
            f"--config.init_from={os.path.dirname(checkpoints.directory)}"
        )
    optimizer = meta.get("optimizer")  # absent before it was recorded
    if optimizer is not None and optimizer != prepared.config.optimizer.name:
        raise ConfigError(
            f"the checkpoint of step {step} in {checkpoints.directory} holds the state of "
            f"config.optimizer.name={optimizer!r}, not {prepared.config.optimizer.name!r}; resume "
            f"with --config.optimizer.name={optimizer}, or start from its weights in a new "
            f"--workdir with --config.init_from={os.path.dirname(checkpoints.directory)}"
        )
    if differences:
        raise ConfigError(
            f"the checkpoint of step {step} in {checkpoints.directory} was written for another "
            f"model or pipeline split ({'; '.join(differences)}); resume with that run's config "
            "(config.model, config.layers_per_stage, config.schedule, config.mesh.pipe), or give "
            "a new --workdir"
        )
