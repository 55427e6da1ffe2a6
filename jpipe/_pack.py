"""Packing: each rank holds only its own stages' parameters, in flat vectors.

Stages differ in structure (the first embeds, the last has the head), so their
parameters cannot be stacked on a ``pipe`` axis. Instead each rank's stages are
laid end to end in one flat vector per dtype, and the vectors of all ranks
form one array ``[R, width]`` sharded over ``pipe``: rank `r`'s row holds the
stages `r` runs and nothing else. Inside the program a stage's arrays are
static slices of its rank's row.

Padding: every row has the same width, the heaviest rank's total plus a tail
as long as the widest stage minus the last stage on that rank (the gradient
accumulator adds a whole stage-width window at a stage's offset). So a rank
holds ``width`` elements where an ideal split would hold its own total; the
figure is reported by `ParamLayout.padding`. Optimizer state built on the
packed arrays (`optax` works on them directly) has the same layout.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jpipe._stage import FlatLayout


@dataclasses.dataclass(frozen=True)
class ParamLayout:
    """Where each stage's parameters live in the packed per-rank vectors."""

    trees: tuple  # per stage: treedef of its parameters
    layouts: tuple[FlatLayout, ...]  # per stage
    stage_to_rank: tuple[int, ...]
    offsets: tuple[dict, ...]  # per stage: {dtype: offset in its rank's vector}
    widths: dict  # {dtype: row width}
    max_stage_sizes: dict  # {dtype: the widest stage}

    @classmethod
    def of(cls, params_list, stage_to_rank) -> ParamLayout:
        trees, layouts = [], []
        for p in params_list:
            leaves, tree = jax.tree.flatten(p)
            trees.append(tree)
            layouts.append(FlatLayout.of(leaves))
        R = max(stage_to_rank) + 1
        used = [dict() for _ in range(R)]
        offsets = []
        for s, layout in enumerate(layouts):
            r = stage_to_rank[s]
            off = {}
            for dt, n in layout.sizes.items():
                off[dt] = used[r].get(dt, 0)
                used[r][dt] = off[dt] + n
            offsets.append(off)
        dtypes = sorted({dt for layout in layouts for dt in layout.sizes})
        max_stage = {dt: max(layout.sizes.get(dt, 0) for layout in layouts) for dt in dtypes}
        widths = {}
        for dt in dtypes:
            ends = [offsets[s].get(dt, 0) + max_stage[dt] for s in range(len(layouts))]
            widths[dt] = max([u.get(dt, 0) for u in used] + ends)
        return cls(tuple(trees), tuple(layouts), tuple(stage_to_rank), tuple(offsets), widths, max_stage)

    @property
    def num_stages(self) -> int:
        return len(self.layouts)

    def offset(self, s: int, dtype: str) -> int:
        return self.offsets[s].get(dtype, 0)

    def stage_layout(self, s: int) -> FlatLayout:
        return self.layouts[s]

    def stage_avals(self, s: int):
        layout = self.layouts[s]
        leaves = [jax.ShapeDtypeStruct(sh, dt) for sh, dt in zip(layout.shapes, layout.dtypes)]
        return jax.tree.unflatten(self.trees[s], leaves)

    def stage_params(self, s: int, flat: dict):
        """Stage `s`'s parameter pytree, sliced from its rank's vectors `flat`."""
        layout = self.layouts[s]
        shifted = {}
        for dt, n in layout.sizes.items():
            off = self.offset(s, dt)
            shifted[dt] = jax.lax.slice_in_dim(flat[dt], off, off + n)
        return jax.tree.unflatten(self.trees[s], layout.unpack(shifted))

    @property
    def padding(self) -> dict:
        """Per dtype: elements held in total over all ranks, and those actually used."""
        R = max(self.stage_to_rank) + 1
        return {
            dt: {"held": R * w, "used": sum(layout.sizes.get(dt, 0) for layout in self.layouts)}
            for dt, w in self.widths.items()
        }

    def pack_host(self, params_list) -> dict:
        """Packs on the host: ``{dtype: numpy [R, width]}``."""
        R = max(self.stage_to_rank) + 1
        out = {dt: np.zeros((R, w), dt) for dt, w in self.widths.items()}
        for s, p in enumerate(params_list):
            leaves, tree = jax.tree.flatten(p)
            if tree != self.trees[s]:
                raise ValueError(f"stage {s}'s parameters changed structure: {tree} vs {self.trees[s]}")
            layout = self.layouts[s]
            r = self.stage_to_rank[s]
            for leaf, shape, dt, off in zip(leaves, layout.shapes, layout.dtypes, layout.offsets):
                a = np.asarray(leaf)
                if a.shape != shape:
                    raise ValueError(f"stage {s}: a parameter has shape {a.shape}, expected {shape}")
                start = self.offset(s, dt) + off
                out[dt][r, start : start + a.size] = a.reshape(-1)
        return out

    def unpack_host(self, packed: dict) -> list:
        """The inverse of `pack_host`, from device or host arrays, as numpy pytrees."""
        host = {dt: np.asarray(jax.device_get(v)) for dt, v in packed.items()}
        out = []
        for s, layout in enumerate(self.layouts):
            r = self.stage_to_rank[s]
            leaves = []
            for shape, dt, off in zip(layout.shapes, layout.dtypes, layout.offsets):
                start = self.offset(s, dt) + off
                n = int(np.prod(shape))
                leaves.append(host[dt][r, start : start + n].reshape(shape))
            out.append(jax.tree.unflatten(self.trees[s], leaves))
        return out

    def sharding(self, mesh, pipe_axis: str) -> dict:
        return {dt: NamedSharding(mesh, P(pipe_axis)) for dt in self.widths}

    def pack(self, params_list, mesh, pipe_axis: str) -> dict:
        """Packs and places the rows on their ranks: ``{dtype: Array [R, width]}``."""
        host = self.pack_host(params_list)
        shardings = self.sharding(mesh, pipe_axis)
        return {
            dt: jax.make_array_from_callback(v.shape, shardings[dt], lambda idx, v=v: v[idx])
            for dt, v in host.items()
        }
