"""Arrays that live on one process's devices, each saved by the process holding it.

In a run of several processes, a rank with a mesh of its own (the
per-rank lowering's, ``lowering="mpmd"`` in ``train.py``) keeps its parameters and optimizer
state on its own devices only: every such array lives on one process. Orbax
saves global arrays, whose shards it splits among the processes, and refuses
an array that one process holds whole ("Cannot serialize host local
jax.Array ... in multi-host setting"); its numpy handler writes on process 0
only. So this module is an orbax item of its own, `ProcessArraysHandler`,
that the checkpoint manager saves beside the global ``state``: each process
writes the arrays it holds, shard by shard from its devices (nothing is
gathered to one host, nothing crosses processes), as TensorStore zarr arrays
(the storage orbax itself writes through), one folder per array named by its
place in the state (``params.1.float32``), so a run with ranks placed on
other processes can still read them.

Why not global arrays: making a rank's state global would put a shard of it
on a device of every process (a copy of the whole state over the network,
or padding every process to the fullest rank's bytes), which is the memory
the per-rank lowering exists to save.

The manager owns the rest: every process writes into the step's temporary
directory, and the step is renamed into place only after all have finished
(`orbax.checkpoint.CheckpointManager`'s barrier), so a step is whole or
absent, as for the global arrays. Each process then writes
``_held_by_<process>.json``, the arrays it wrote; `missing_files` checks
them before a step is read.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
import tensorstore as ts

INDEX = "_held_by_{}.json"


def held_by_one_process(x) -> bool:
    """Whether `x` (an array or a `jax.ShapeDtypeStruct` with a sharding) lives on one process
    of several: such an array is saved by `ProcessArraysHandler`, not by orbax's array handler."""
    if jax.process_count() == 1:
        return False
    sharding = getattr(x, "sharding", None)
    if sharding is None:
        return False
    return len({d.process_index for d in sharding.device_set}) == 1


def is_mine(x) -> bool:
    """Whether this process holds `x` (`held_by_one_process` arrays only)."""
    return next(iter(x.sharding.device_set)).process_index == jax.process_index()


def held_elsewhere(target) -> jax.Array:
    """Another process's array, as this process holds it: no shards here."""
    return jax.make_array_from_single_device_arrays(
        target.shape, target.sharding, [], dtype=target.dtype
    )


def _spec(folder: str) -> dict:
    return {"driver": "zarr", "kvstore": {"driver": "file", "path": folder}}


@dataclasses.dataclass
class ProcessArraysSave(ocp.args.CheckpointArgs):
    """Every process's `held_by_one_process` arrays, by name; each process writes its own."""

    arrays: dict[str, Any]


@dataclasses.dataclass
class ProcessArraysRestore(ocp.args.CheckpointArgs):
    """What to read, by name: `jax.ShapeDtypeStruct`s with the shardings to place them on."""

    targets: dict[str, Any]


class ProcessArraysHandler(ocp.CheckpointHandler):
    """Saves and restores the arrays this process holds (see the module's docstring)."""

    def save(self, directory, args: ProcessArraysSave) -> None:
        root = os.fspath(directory)
        os.makedirs(root, exist_ok=True)
        writes, written = [], {}
        for name, x in sorted(args.arrays.items()):
            if not is_mine(x):
                continue
            shard_shape = x.sharding.shard_shape(x.shape)
            store = ts.open(
                _spec(os.path.join(root, name)),
                create=True,
                delete_existing=True,
                dtype=ts.dtype(np.dtype(x.dtype).name),
                shape=x.shape,
                # One chunk per shard: the shards' writes never share a chunk.
                chunk_layout=ts.ChunkLayout(chunk_shape=[max(1, n) for n in shard_shape]),
            ).result()
            for shard in x.addressable_shards:
                if shard.replica_id == 0:  # a replicated shard is written once
                    writes.append(store[shard.index].write(np.asarray(shard.data)))
            written[name] = [list(x.shape), np.dtype(x.dtype).name]
        for w in writes:
            w.result()
        index = os.path.join(root, INDEX.format(jax.process_index()))
        with open(index + ".tmp", "w") as f:
            json.dump(written, f, sort_keys=True)
        os.replace(index + ".tmp", index)

    def restore(self, directory, args: ProcessArraysRestore) -> dict:
        root = os.fspath(directory)
        restored = {}
        for name, target in sorted(args.targets.items()):
            sharding = target.sharding
            indices = sharding.addressable_devices_indices_map(tuple(target.shape))
            if not indices:
                restored[name] = held_elsewhere(target)
                continue
            store = ts.open(_spec(os.path.join(root, name)), open=True).result()
            saved, wanted = store.dtype.numpy_dtype, np.dtype(target.dtype)
            if tuple(store.shape) != tuple(target.shape) or saved != wanted:
                raise ValueError(
                    f"{os.path.join(root, name)} holds {saved}{list(store.shape)}, this run's "
                    f"state {wanted}{list(target.shape)}"
                )
            reads = {d: store[index].read() for d, index in indices.items()}
            restored[name] = jax.make_array_from_single_device_arrays(
                target.shape,
                sharding,
                [jax.device_put(r.result(), d) for d, r in reads.items()],
            )
        return restored

    def metadata(self, directory) -> dict:
        """The arrays each process wrote: ``{name: [shape, dtype]}``."""
        held = {}
        root = os.fspath(directory)
        for name in sorted(os.listdir(root)):
            if name.startswith("_held_by_") and name.endswith(".json"):
                with open(os.path.join(root, name)) as f:
                    held.update(json.load(f))
        return held


ocp.args.register_with_handler(ProcessArraysHandler, for_save=True)(ProcessArraysSave)
ocp.args.register_with_handler(ProcessArraysHandler, for_restore=True)(ProcessArraysRestore)


def missing_files(directory: str, processes: int) -> str | None:
    """What is missing of a saved item of `processes` processes, or None when nothing is."""
    for p in range(processes):
        index = os.path.join(directory, INDEX.format(p))
        try:
            with open(index) as f:
                written = json.load(f)
        except (OSError, ValueError):
            return f"{index} is missing or cannot be read"
        for name in written:
            if not os.path.isfile(os.path.join(directory, name, ".zarray")):
                return f"{os.path.join(directory, name, '.zarray')} is missing"
    return None


def read_on_host(directory: str, name: str) -> np.ndarray:
    """The whole array `name` of a saved item, read into this host's memory (by
    `jpipe.train.load_params`, which needs no device of the run that wrote it)."""
    store = ts.open(_spec(os.path.join(os.fspath(directory), name)), open=True).result()
    return np.asarray(store.read().result())
