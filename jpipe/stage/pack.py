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

Splits inside a stage: the mesh may have axes besides ``pipe`` and
``data``. The program is manual over all of them (`jpipe.lower.spmd.program`), so each
device holds, and each stage sees, its own block of an array:

- A *model* axis (``tensor``): an array given a `PartitionSpec` over it
  (`ParamLayout.of`'s `specs`) keeps its shape in bucket
  ``(dtype, shape, spec, n)``, an array ``[R, *shape]`` sharded
  ``P(pipe, *spec)``. The stage function gets the device's block (a
  Megatron column-split ``[D, 3D]`` weight arrives as ``[D, 3D / T]``) and
  writes the collectives itself with plain JAX (``lax.psum(y, "tensor")``),
  as `jpipe.models.gpt` does; `jpipe.stage.manual` traces it so that their
  gradients are JAX's own.
- The ``fsdp`` axis: every array is split over it too (ZeRO-3: parameters,
  gradients and optimizer state): a flat bucket along its row, a shaped one
  along its first dimension no other axis splits and the axis divides (an
  array nothing divides stays whole). The program gathers a stage's arrays
  just before each of its pieces runs and reduce-scatters the weight
  gradients, so the stage sees whole (fsdp-gathered) arrays.
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


def _shaped_bucket_name(dtype: str, shape: tuple, spec: tuple, n: int) -> str:
    dims = "x".join(str(d) for d in shape)
    axes = ",".join("-".join(a) if isinstance(a, tuple) else str(a) for a in spec)
    return f"{dtype}[{dims}]({axes})#{n}"


def _axes_of(entry) -> tuple:
    """The mesh axes one entry of a `PartitionSpec` names."""
    if entry is None:
        return ()
    return tuple(entry) if isinstance(entry, tuple) else (entry,)


def with_axis(shape: tuple, spec: tuple, axis: str, size: int) -> tuple:
    """`spec` with `axis` on the first dimension of `shape` it leaves free and `size` divides.

    Unchanged if no dimension qualifies (the array is not split over `axis`).
    """
    for d, (n, e) in enumerate(zip(shape, spec)):
        if e is None and n % size == 0:
            return spec[:d] + (axis,) + spec[d + 1 :]
    return spec


def _is_spec_leaf(x) -> bool:
    return x is None or isinstance(x, P)


@dataclasses.dataclass(frozen=True)
class ParamLayout:
    """Which bucket holds each stage's parameter arrays.

    Attributes:
      trees: per stage, the treedef of its parameters.
      leaves: per stage, one ``(bucket name, shape, dtype)`` per array.
      stage_to_rank: the rank of each stage (of a replicated stage, its first).
      num_ranks: the ranks (a rank may hold no stage).
      buckets: ``{name: (shape, dtype)}`` for every bucket (the shape of one
        rank's row: ``(size,)`` for a flat bucket).
      specs: ``{name: spec}``, how each bucket's row is split over the mesh
        axes other than ``pipe`` (a tuple as long as its shape).
      axis_sizes: the sizes of the mesh axes the specs may name.
      fsdp_axis: the axis every array is split over as well, if any.
      stage_ranks: per stage, every rank that holds a copy of it (one rank,
        or several for a replicated stage). A copy's arrays go into the same
        buckets on each of its ranks, so a stage's leaves name one bucket
        each wherever it runs.
    """

    trees: tuple
    leaves: tuple
    stage_to_rank: tuple[int, ...]
    num_ranks: int
    buckets: dict = dataclasses.field(hash=False)
    specs: dict = dataclasses.field(default_factory=dict, hash=False)
    axis_sizes: dict = dataclasses.field(default_factory=dict, hash=False)
    fsdp_axis: str | None = None
    stage_ranks: tuple[tuple[int, ...], ...] = ()

    def __post_init__(self):
        if not self.stage_ranks:
            object.__setattr__(self, "stage_ranks", tuple((r,) for r in self.stage_to_rank))

    @classmethod
    def of(
        cls,
        params_list,
        stage_to_rank,
        num_ranks: int,
        specs=None,
        axis_sizes: dict[str, int] | None = None,
        fsdp_axis: str | None = None,
        stage_ranks=None,
    ) -> ParamLayout:
        """Lays out `params_list` (one pytree per stage) over `num_ranks` ranks.

        Args:
          params_list: one parameter pytree per stage (arrays or shape structs).
          stage_to_rank: the rank of each stage.
          num_ranks: the number of ranks.
          specs: optional, one pytree per stage like its parameters with a
            `PartitionSpec` (or None: not split) per array, over mesh axes
            other than ``pipe`` and ``data``.
          axis_sizes: the mesh's axis sizes, to check `specs` against.
          fsdp_axis: a mesh axis to split every array over as well (ZeRO-3).
          stage_ranks: per stage, the ranks holding a copy of it (default:
            `stage_to_rank`'s one each).
        """
        axis_sizes = dict(axis_sizes or {})
        if axis_sizes.get(fsdp_axis, 1) == 1:
            fsdp_axis = None  # nothing to split over

        def split_over_fsdp(shape, spec):
            if fsdp_axis is None:
                return spec
            return with_axis(shape, spec, fsdp_axis, axis_sizes[fsdp_axis])

        if specs is None:
            specs = [None] * len(params_list)
        if len(specs) != len(params_list):
            raise ValueError(
                f"got partition specs for {len(specs)} stages and parameters for {len(params_list)}"
            )
        counts: dict = {}  # (rank, bucket key) -> arrays so far
        trees, leaves, buckets, bucket_specs = [], [], {}, {}
        for s, p in enumerate(params_list):
            with_paths, tree = jax.tree_util.tree_flatten_with_path(p)
            trees.append(tree)
            stage_specs = _stage_specs(s, specs[s], p, len(with_paths))
            ranks = tuple(stage_ranks[s]) if stage_ranks is not None else (stage_to_rank[s],)
            entries = []
            for (path, leaf), spec in zip(with_paths, stage_specs):
                dtype = getattr(leaf, "dtype", None)
                if not hasattr(leaf, "shape") or not jnp.issubdtype(dtype, jnp.floating):
                    raise ValueError(
                        f"stage {s}'s parameter {jax.tree_util.keystr(path) or '(root)'} is "
                        f"{type(leaf).__name__} {dtype or ''}; parameters must be floating-point "
                        "arrays (keep integer constants in the stage function or the inputs)"
                    )
                shape, dtype = tuple(leaf.shape), str(np.dtype(leaf.dtype))
                size = math.prod(shape)
                spec = _check_spec(s, path, shape, spec, axis_sizes, fsdp_axis)
                flat = all(e is None for e in spec)
                row = (size,) if flat else shape
                row_spec = split_over_fsdp(row, (None,) if flat else spec)
                key = (dtype, size) if flat else (dtype, shape, row_spec)
                # The first index free on every rank holding a copy, so
                # that the copies share a bucket name.
                n = max(counts.get((r, key), 0) for r in ranks)
                for r in ranks:
                    counts[(r, key)] = n + 1
                if flat:
                    name = _bucket_name(dtype, size, n)
                else:
                    name = _shaped_bucket_name(dtype, shape, row_spec, n)
                buckets[name] = (row, dtype)
                bucket_specs[name] = row_spec
                entries.append((name, shape, dtype))
            leaves.append(tuple(entries))
        return cls(
            tuple(trees),
            tuple(leaves),
            tuple(stage_to_rank),
            num_ranks,
            buckets,
            bucket_specs,
            axis_sizes,
            fsdp_axis,
            tuple(tuple(stage_ranks[s]) for s in range(len(params_list)))
            if stage_ranks is not None
            else (),
        )

    def _divided(self, name: str, skip: str | None = None) -> tuple:
        """Bucket `name`'s row as one device holds it, not counting axis `skip`."""
        row = self.buckets[name][0]
        spec = self.specs.get(name, (None,) * len(row))
        return tuple(
            n // math.prod(self.axis_sizes[a] for a in _axes_of(e) if a != skip)
            for n, e in zip(row, spec)
        )

    def local_shape(self, name: str) -> tuple:
        """Bucket `name`'s row as each device holds it (split over every axis of its spec)."""
        return self._divided(name)

    def gathered_shape(self, name: str) -> tuple:
        """Bucket `name`'s row as a stage sees it: gathered over ``fsdp``, split over the rest."""
        return self._divided(name, skip=self.fsdp_axis)

    def fsdp_dim(self, name: str) -> int | None:
        """The dimension of bucket `name`'s row that ``fsdp`` splits, if it does."""
        if self.fsdp_axis is None:
            return None
        spec = self.specs.get(name, ())
        return next((d for d, e in enumerate(spec) if self.fsdp_axis in _axes_of(e)), None)

    def _compute_shape(self, name: str, shape: tuple) -> tuple:
        """An array of `shape` in bucket `name` as its stage sees it."""
        if self.buckets[name][0] == shape:  # a shaped bucket (or a 1-D array's flat one)
            return self.gathered_shape(name)
        return shape  # a flat row: gathered, it is the whole array

    def stage_avals(self, s: int):
        """Stage `s`'s parameters as its function sees them (its block of each split array)."""
        return jax.tree.unflatten(
            self.trees[s],
            [
                jax.ShapeDtypeStruct(self._compute_shape(name, sh), dt)
                for name, sh, dt in self.leaves[s]
            ],
        )

    def stage_axes(self, s: int) -> tuple[frozenset, ...]:
        """Per parameter leaf of stage `s`, the mesh axes other than fsdp that split it."""
        out = []
        for name, shape, _ in self.leaves[s]:
            if self.buckets[name][0] != shape:  # a flat row: never split
                out.append(frozenset())
                continue
            spec = self.specs.get(name, ())
            axes = {a for e in spec for a in _axes_of(e)}
            out.append(frozenset(axes - {self.fsdp_axis}))
        return tuple(out)

    def stage_params(self, s: int, rows: dict):
        """Stage `s`'s parameters from its rank's rows ``{bucket: row}``, gathered over fsdp."""
        return jax.tree.unflatten(
            self.trees[s],
            [
                rows[name].reshape(self._compute_shape(name, shape))
                for name, shape, _ in self.leaves[s]
            ],
        )

    def stage_buckets(self, s: int) -> tuple[str, ...]:
        return tuple(name for name, _, _ in self.leaves[s])

    def rank_buckets(self, r: int) -> tuple[str, ...]:
        """The buckets rank `r`'s stages use, in stage order (the others are its padding)."""
        return tuple(
            dict.fromkeys(
                b
                for s, ranks in enumerate(self.stage_ranks)
                if r in ranks
                for b in self.stage_buckets(s)
            )
        )

    def on_axes(self, axis_sizes: dict[str, int]) -> ParamLayout:
        """This layout over axes of other sizes (a rank's own mesh), its specs checked there."""
        for name, (row, _) in self.buckets.items():
            for n, e in zip(row, self.specs.get(name, (None,) * len(row))):
                ways = math.prod(axis_sizes.get(a, 1) for a in _axes_of(e))
                if n % ways:
                    raise ValueError(
                        f"bucket {name}: a dimension of {n} cannot be split {ways} ways over "
                        f"{_axes_of(e)} (sizes {axis_sizes})"
                    )
        return dataclasses.replace(self, axis_sizes=dict(axis_sizes))

    def counted_rows(self) -> dict[str, np.ndarray]:
        """``{bucket: bool[R]}``: the rows a global norm counts, all but the copies.

        A replicated stage's arrays sit in one row per rank that holds it;
        a norm over every stage counts them once, from the stage's first
        rank. Every row is True where no stage is replicated.
        """
        rows = {name: np.ones(self.num_ranks, bool) for name in self.buckets}
        for s, (_, *copies) in enumerate(self.stage_ranks):
            for name in self.stage_buckets(s):
                rows[name][copies] = False
        return rows

    @property
    def padding(self) -> dict:
        """Elements held over all ranks (``held``), those the stages' arrays fill
        (``used``: a replicated stage's copies each count) and the model's own
        (``model``: each stage once), and the share of ``held`` that is padding."""
        held = sum(self.num_ranks * math.prod(shape) for shape, _ in self.buckets.values())
        model = used = 0
        for entries, ranks in zip(self.leaves, self.stage_ranks, strict=True):
            n = sum(math.prod(sh) for _, sh, _ in entries)
            model += n
            used += len(ranks) * n
        fraction = 1 - used / held if held else 0.0
        return {"held": held, "used": used, "model": model, "padding_fraction": fraction}

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
            for leaf, (name, shape, _) in zip(flat, self.leaves[s]):
                a = np.asarray(leaf)
                if a.shape != shape:
                    raise ValueError(
                        f"stage {s}: a parameter has shape {a.shape}, expected {shape}"
                    )
                for r in self.stage_ranks[s]:
                    out[name][r] = a.reshape(self.buckets[name][0])
        return out

    def unpack_host(self, packed: dict) -> list:
        """The inverse of `pack_host`, from device or host arrays, as numpy pytrees.

        Arrays spread over several processes are gathered with
        `multihost_utils.process_allgather`, a collective: in a multi-process
        run every process must call this together, and each gets every stage.
        A replicated stage is read from its first rank (its copies are equal).
        """
        host = {name: _to_host(v) for name, v in packed.items()}
        return [
            jax.tree.unflatten(
                self.trees[s],
                [host[name][self.stage_to_rank[s]].reshape(sh) for name, sh, _ in self.leaves[s]],
            )
            for s in range(len(self.trees))
        ]

    def spec(self, name: str, pipe_axis: str, extra: tuple[str, int] | None = None) -> P:
        """Bucket `name`'s `PartitionSpec`: rows over `pipe_axis`, then its own split.

        `extra`: ``(axis, size)`` to split over as well, on the first dimension
        of the device's block that the spec leaves free and `size` divides
        (ZeRO-1's ``data``), if there is one.
        """
        spec = self.specs.get(name, (None,) * len(self.buckets[name][0]))
        if extra is not None:
            spec = with_axis(self.local_shape(name), spec, *extra)
        return P(pipe_axis, *spec) if any(e is not None for e in spec) else P(pipe_axis)

    def sharding(self, mesh, pipe_axis: str) -> dict:
        return {name: NamedSharding(mesh, self.spec(name, pipe_axis)) for name in self.buckets}

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
                for r in self.stage_ranks[s]:
                    contents[(name, r)] = (s, k)
        flat = [jax.tree.leaves(p) for p in params_list]
        R = self.num_ranks

        def rows(name, idx):
            row, dt = self.buckets[name]
            ranks = range(R)[idx[0]]
            part = tuple(idx[1:])
            shape = np.empty(row, np.bool_)[part].shape if part else row
            out = np.zeros((len(ranks),) + shape, dt)
            for i, r in enumerate(ranks):
                if (name, r) in contents:
                    s, k = contents[(name, r)]
                    out[i] = np.asarray(flat[s][k]).reshape(row)[part]
            return out

        return {
            name: jax.make_array_from_callback(
                (R,) + shape, shardings[name], lambda idx, name=name: rows(name, idx)
            )
            for name, (shape, _) in self.buckets.items()
        }

    def rank_rows(self, r: int, params_list) -> dict:
        """Rank `r`'s rows of every bucket, ``{bucket: [1, *row]}``, traceable.

        Only rank `r`'s stages are read (the others may be shape structs):
        a bucket that none of them fills gets zeros.
        """
        rows = {name: jnp.zeros(row, dt) for name, (row, dt) in self.buckets.items()}
        for s, entries in enumerate(self.leaves):
            if r in self.stage_ranks[s]:
                for leaf, (name, _, _) in zip(jax.tree.leaves(params_list[s]), entries):
                    rows[name] = jnp.reshape(leaf, self.buckets[name][0])
        return {name: row[None] for name, row in rows.items()}

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


def _stage_specs(s: int, specs, params, count: int) -> list:
    """Stage `s`'s specs, one per parameter array (None for none given)."""
    if specs is None:
        return [None] * count
    flat, tree = jax.tree.flatten(specs, is_leaf=_is_spec_leaf)
    if tree != jax.tree.structure(params, is_leaf=_is_spec_leaf) or len(flat) != count:
        raise ValueError(
            f"stage {s}'s partition specs do not match its parameters: give one "
            f"PartitionSpec (or None) per array, in a tree like the parameters' ({tree} "
            f"against {jax.tree.structure(params)})"
        )
    return flat


def _check_spec(s: int, path, shape: tuple, spec, axis_sizes: dict, fsdp_axis) -> tuple:
    """`spec` as a tuple as long as `shape`, checked against the mesh."""
    where = f"stage {s}'s parameter {jax.tree_util.keystr(path) or '(root)'} of shape {shape}"
    entries = tuple(spec) if spec is not None else ()
    if len(entries) > len(shape):
        raise ValueError(f"{where} has a PartitionSpec {spec} with more entries than dimensions")
    entries = entries + (None,) * (len(shape) - len(entries))
    named = [a for e in entries for a in _axes_of(e)]
    if len(set(named)) < len(named):
        raise ValueError(f"{where} has a PartitionSpec {spec} that names an axis twice")
    for d, entry in enumerate(entries):
        axes = _axes_of(entry)
        size = 1
        for a in axes:
            if a == fsdp_axis:
                raise ValueError(
                    f"{where} is split over {a!r}, the fsdp axis, which splits every array "
                    "by itself: leave it out of the specs"
                )
            if a not in axis_sizes:
                raise ValueError(
                    f"{where} is split over {a!r}, which is not an axis of the mesh "
                    f"{tuple(axis_sizes)}"
                )
            size *= axis_sizes[a]
        if shape[d] % size:
            raise ValueError(
                f"{where}: dimension {d} of size {shape[d]} cannot be split {size} ways over {axes}"
            )
    return entries


def _to_host(value) -> np.ndarray:
    """A numpy copy of `value`, gathering from other processes where it spans them."""
    if isinstance(value, jax.Array) and not value.is_fully_addressable:
        from jax.experimental import multihost_utils

        return np.asarray(multihost_utils.process_allgather(value, tiled=True))
    return np.asarray(jax.device_get(value))
