"""Packing: each rank holds only its own stages' parameters.

Stages differ in structure (the first embeds, the last has the head), so their
parameters cannot simply be stacked on a ``pipe`` axis. Instead every array a
rank holds goes into a *bucket*: the n-th array of a given size and dtype on a
rank goes into bucket ``(dtype, size, n)``, an array ``[R, size]`` sharded over
``pipe`` whose row `r` is rank `r`'s array, flattened. Inside the program a
stage's array is the local row of its bucket reshaped, which XLA reads in
place (a reshape of a whole row is free; a slice of one long flat vector would
be copied before every matmul).

Padding: a bucket has a row on every rank, so a rank that has no array of that
size holds zeros. When the stages of all ranks are alike (the blocks of a
transformer) nothing is padded; arrays of the same size share a bucket
whatever their shape (an embedding ``[V, D]`` on the first rank and a head
``[D, V]`` on the last share one); an array whose size only one rank has costs
R - 1 rows of padding. `ParamLayout.padding` reports the
figures. Optimizer state built on the packed dict (`optax` works on it
directly) has the same layout.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P


def _bucket_name(dtype: str, size: int, n: int) -> str:
    return f"{dtype}[{size}]#{n}"


@dataclasses.dataclass(frozen=True)
class ParamLayout:
    """Which bucket holds each stage's parameter arrays.

    Attributes:
      trees: per stage, the treedef of its parameters.
      leaves: per stage, one ``(bucket name, shape, dtype)`` per array.
      stage_to_rank: the rank of each stage.
      num_ranks: the ranks (a rank may hold no stage).
      buckets: ``{name: ((size,), dtype)}`` for every bucket.
    """

    trees: tuple
    leaves: tuple
    stage_to_rank: tuple[int, ...]
    num_ranks: int
    buckets: dict = dataclasses.field(hash=False)

    @classmethod
    def of(cls, params_list, stage_to_rank, num_ranks: int) -> ParamLayout:
        """Lays out `params_list` (one pytree per stage) over `num_ranks` ranks."""
        counts: dict = {}  # (rank, dtype, shape) -> arrays so far
        trees, leaves, buckets = [], [], {}
        for s, p in enumerate(params_list):
            with_paths, tree = jax.tree_util.tree_flatten_with_path(p)
            trees.append(tree)
            r = stage_to_rank[s]
            entries = []
            for path, leaf in with_paths:
                dtype = getattr(leaf, "dtype", None)
                if not hasattr(leaf, "shape") or not jnp.issubdtype(dtype, jnp.floating):
                    raise ValueError(
                        f"stage {s}'s parameter {jax.tree_util.keystr(path) or '(root)'} is "
                        f"{type(leaf).__name__} {dtype or ''}; parameters must be floating-point "
                        "arrays (keep integer constants in the stage function or the inputs)"
                    )
                shape, dtype = tuple(leaf.shape), str(np.dtype(leaf.dtype))
                size = math.prod(shape)
                n = counts.get((r, dtype, size), 0)
                counts[(r, dtype, size)] = n + 1
                name = _bucket_name(dtype, size, n)
                buckets[name] = ((size,), dtype)
                entries.append((name, shape, dtype))
            leaves.append(tuple(entries))
        return cls(tuple(trees), tuple(leaves), tuple(stage_to_rank), num_ranks, buckets)

    def stage_avals(self, s: int):
        return jax.tree.unflatten(
            self.trees[s], [jax.ShapeDtypeStruct(sh, dt) for _, sh, dt in self.leaves[s]]
        )

    def stage_params(self, s: int, local: dict):
        """Stage `s`'s parameters from its rank's rows ``{bucket: [size]}``."""
        return jax.tree.unflatten(
            self.trees[s], [local[name].reshape(shape) for name, shape, _ in self.leaves[s]]
        )

    def stage_buckets(self, s: int) -> tuple[str, ...]:
        return tuple(name for name, _, _ in self.leaves[s])

    @property
    def padding(self) -> dict:
        """Elements held over all ranks, and those the stages actually use."""
        held = sum(self.num_ranks * math.prod(shape) for shape, _ in self.buckets.values())
        used = sum(math.prod(sh) for entries in self.leaves for _, sh, _ in entries)
        return {"held": held, "used": used, "padding_fraction": 1 - used / held if held else 0.0}

    def pack_host(self, params_list) -> dict:
        """Packs on the host: ``{bucket: numpy [R, *shape]}``."""
        if len(params_list) != len(self.trees):
            raise ValueError(
                f"got {len(params_list)} stages' parameters, expected {len(self.trees)}"
            )
        R = self.num_ranks
        out = {name: np.zeros((R,) + shape, dt) for name, (shape, dt) in self.buckets.items()}
        for s, p in enumerate(params_list):
            flat, tree = jax.tree.flatten(p)
            if tree != self.trees[s]:
                raise ValueError(
                    f"stage {s}'s parameters changed structure: {tree} vs {self.trees[s]}"
                )
            r = self.stage_to_rank[s]
            for leaf, (name, shape, _) in zip(flat, self.leaves[s]):
                a = np.asarray(leaf)
                if a.shape != shape:
                    raise ValueError(
                        f"stage {s}: a parameter has shape {a.shape}, expected {shape}"
                    )
                out[name][r] = a.reshape(-1)
        return out

    def unpack_host(self, packed: dict) -> list:
        """The inverse of `pack_host`, from device or host arrays, as numpy pytrees.

        Arrays spread over several processes are gathered with
        `multihost_utils.process_allgather`, a collective: in a multi-process
        run every process must call this together, and each gets every stage.
        """
        host = {name: _to_host(v) for name, v in packed.items()}
        return [
            jax.tree.unflatten(
                self.trees[s],
                [host[name][self.stage_to_rank[s]].reshape(sh) for name, sh, _ in self.leaves[s]],
            )
            for s in range(len(self.trees))
        ]

    def sharding(self, mesh, pipe_axis: str) -> dict:
        return {name: NamedSharding(mesh, P(pipe_axis)) for name in self.buckets}

    def pack(self, params_list, mesh, pipe_axis: str) -> dict:
        """Packs and places each row on its rank: ``{bucket: Array [R, *shape]}``.

        Rows are built on demand for the shards this process holds, so in a
        multi-process run a host copies only its own ranks' parameters to
        numpy (each stage's parameters need to be readable only where its rank is).
        """
        self._check_structure(params_list)
        shardings = self.sharding(mesh, pipe_axis)
        contents: dict = {}  # (bucket, rank) -> (stage, leaf index)
        for s, entries in enumerate(self.leaves):
            for k, (name, _, _) in enumerate(entries):
                contents[(name, self.stage_to_rank[s])] = (s, k)
        flat = [jax.tree.leaves(p) for p in params_list]
        R = self.num_ranks

        def rows(name, idx):
            (size,), dt = self.buckets[name]
            ranks = range(R)[idx[0]]
            out = np.zeros((len(ranks), size), dt)
            for i, r in enumerate(ranks):
                if (name, r) in contents:
                    s, k = contents[(name, r)]
                    out[i] = np.asarray(flat[s][k]).reshape(-1)
            return out[(slice(None),) + tuple(idx[1:])]

        return {
            name: jax.make_array_from_callback(
                (R,) + shape, shardings[name], lambda idx, name=name: rows(name, idx)
            )
            for name, (shape, _) in self.buckets.items()
        }

    def _check_structure(self, params_list) -> None:
        if len(params_list) != len(self.trees):
            raise ValueError(
                f"got {len(params_list)} stages' parameters, expected {len(self.trees)}"
            )
        for s, p in enumerate(params_list):
            flat, tree = jax.tree.flatten(p)
            if tree != self.trees[s]:
                raise ValueError(
                    f"stage {s}'s parameters changed structure: {tree} vs {self.trees[s]}"
                )
            for leaf, (_, shape, _) in zip(flat, self.leaves[s]):
                if tuple(leaf.shape) != shape:
                    raise ValueError(
                        f"stage {s}: a parameter has shape {tuple(leaf.shape)}, expected {shape}"
                    )


def _to_host(value) -> np.ndarray:
    """A numpy copy of `value`, gathering from other processes where it spans them."""
    if isinstance(value, jax.Array) and not value.is_fully_addressable:
        from jax.experimental import multihost_utils

        return np.asarray(multihost_utils.process_allgather(value, tiled=True))
    return np.asarray(jax.device_get(value))
