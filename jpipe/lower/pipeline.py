"""The user's entry point to the compiler: `Pipeline`.

A `Pipeline` ties a model (an ordered list of stage functions), a schedule
and a mesh together. It checks that they fit before anything is compiled,
packs parameters so each rank holds only its own stages (`jpipe.stage.pack`), and
builds the jitted step ``(packed_params, batch) -> (loss, packed_grads)``
whose loss is the mean over microbatches and whose gradients are those of
`jax.value_and_grad` of the unpipelined model.

Microbatches: the batch's leading axis (size N) is cut into M microbatches of
N / M rows; microbatch `m` takes rows ``m, m + M, m + 2M, ...``, so that when
the batch is sharded over a ``data`` axis every microbatch is too.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jpipe.lower.interface import KINDS, Lowering, LoweringKind, lowering_kind
from jpipe.lower.microbatch import microbatches
from jpipe.lower.spmd.program import CONTROLS, Program, trace_kernels
from jpipe.lower.spmd.ticks import check_layout as check_tick_layout
from jpipe.schedule.actions import Schedule
from jpipe.schedule.validate import analyze
from jpipe.stage.pack import ParamLayout
from jpipe.stage.pieces import WeightedLoss

LOWERINGS = tuple(KINDS)
"""The lowerings of a schedule (`Pipeline`'s `lowering`; `jpipe.lower.interface`)."""


def make_mesh(
    pipe: int,
    data: int = 1,
    devices=None,
    *,
    fsdp: int = 1,
    tensor: int = 1,
    across_hosts: dict[str, int] | None = None,
) -> Mesh:
    """A ``(pipe, data, fsdp, tensor)`` mesh, axis types Auto, hosts' devices side by side.

    A host here is a process (`jax.Device.process_index`): run one process
    per machine and the two coincide.

    The axes, outermost first (the program is manual over all of them):
    ``pipe`` (stages), ``data`` (plain data parallelism: each device runs its
    rows, gradients are averaged once a step), ``fsdp`` (data parallelism
    with every parameter, gradient and optimizer state split over it, ZeRO-3:
    gathered before each piece, gradients reduce-scattered) and ``tensor``
    (the splits the stages' parameters are given, Megatron-style, with the
    collectives in the stage functions; see `Pipeline.pack`). Tensor is
    innermost so that its frequent collectives stay between neighbouring
    devices (on one host, with NVLink); pipe is outermost as it
    sends the least.

    Args:
      pipe, data, fsdp, tensor: the sizes of the axes; an axis of size 1 is
        still there, so code and specs can name it.
      devices: the devices to use (default `jax.devices()`). Without
        `across_hosts` the first ``pipe * data * fsdp * tensor`` of them fill
        the grid row by row, in the order given (by default sorted by
        ``(process_index, id)``, so a process's devices are neighbours and
        ``pipe`` is the axis that crosses hosts first).
      across_hosts: how many hosts each axis spans, e.g. ``{"pipe": 2}``;
        axes not named stay within a host. Like
        `jax.experimental.mesh_utils.create_hybrid_device_mesh`, each axis of
        size ``n = across * within`` takes ``across`` hosts and ``within``
        devices on each, with a host's devices at consecutive indices. The
        product of the across sizes must equal the number of hosts among
        `devices`, and every host must hold the same number of them. Pipe
        across hosts sends one activation per microbatch between neighbours;
        data across hosts all-reduces every gradient each step (see
        docs/multihost.md).

    Raises:
      ValueError: sizes the devices do not fit, naming what is there.
    """
    import numpy as np

    sizes = {"pipe": pipe, "data": data, "fsdp": fsdp, "tensor": tensor}
    bad = {k: v for k, v in sizes.items() if not isinstance(v, int) or v < 1}
    if bad:
        raise ValueError(f"mesh sizes must be whole numbers of at least 1, got {bad}")
    if devices is None:
        devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
    devices = list(devices)
    shape, names = tuple(sizes.values()), tuple(sizes)
    n = math.prod(shape)
    if across_hosts is None:
        if n > len(devices):
            described = " x ".join(f"{k}={v}" for k, v in sizes.items() if v > 1 or k == "pipe")
            hint = ""
            if all(d.platform == "cpu" for d in devices):
                hint = (
                    f". To fake {n} CPU devices, call jax.config.update('jax_num_cpu_devices', "
                    f"{n}) (or jpipe.use_cpu_devices({n})) right after importing JAX, before "
                    "any JAX work, or set "
                    f"XLA_FLAGS=--xla_force_host_platform_device_count={n} before starting Python"
                )
            raise ValueError(
                f"a mesh of {described} needs {n} devices, but only {len(devices)} "
                f"{'is' if len(devices) == 1 else 'are'} present{hint}"
            )
        grid = np.array(devices[:n]).reshape(shape)
    else:
        grid = _host_grid(devices, dict(zip(names, shape)), across_hosts)
    return Mesh(grid, names, axis_types=(AxisType.Auto,) * len(names))


def make_rank_meshes(shapes: Sequence[dict[str, int]], devices=None) -> list[Mesh]:
    """One mesh per pipeline rank, each of its own shape, for the per-rank lowering.

    Each has `make_mesh`'s axes ``(pipe, data, fsdp, tensor)`` with ``pipe``
    of size 1 and the sizes its entry of `shapes` gives (the others 1); the
    ranks take consecutive devices, in order. E.g. a first stage on one
    device and the others on tensor-parallel pairs:
    ``make_rank_meshes([{"tensor": 1}, {"tensor": 2}, {"tensor": 2}])``
    (5 devices). Pass the list as `Pipeline`'s mesh, with ``lowering="mpmd"``.

    Args:
      shapes: per rank, ``{"data": d, "fsdp": f, "tensor": t}`` (any of
        them; ``data`` and ``fsdp`` must agree across ranks).
      devices: the devices to take from (default `jax.devices()`, sorted by
        ``(process_index, id)``).
    """
    if devices is None:
        devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
    devices = list(devices)
    meshes, at = [], 0
    for r, shape in enumerate(shapes):
        unknown = set(shape) - {"data", "fsdp", "tensor"}
        if unknown:
            raise ValueError(
                f"rank {r}'s mesh names {sorted(unknown)}; accepted: data, fsdp, tensor"
            )
        n = math.prod(shape.values())
        if at + n > len(devices):
            raise ValueError(
                f"the rank meshes {list(shapes)} need {at + n}+ devices, but only "
                f"{len(devices)} are present"
            )
        meshes.append(
            make_mesh(
                1,
                shape.get("data", 1),
                devices[at : at + n],
                fsdp=shape.get("fsdp", 1),
                tensor=shape.get("tensor", 1),
            )
        )
        at += n
    return meshes


def _check_rank_meshes(
    meshes,
    schedule: Schedule,
    lowering: LoweringKind,
    pipe_axis: str,
    data_axis: str,
    fsdp_axis: str,
) -> tuple[Mesh, ...]:
    """One mesh per rank, checked: the per-rank lowering, the same axes and batch sizes."""
    meshes = tuple(_auto(m) for m in meshes)
    if not meshes or not all(isinstance(m, Mesh) for m in meshes):
        raise ValueError("mesh must be a jax Mesh, or (lowering='mpmd') a list of one per rank")
    if not lowering.meshes_per_rank:
        raise ValueError(
            "one mesh per rank (ranks of different shapes) needs the per-rank lowering: "
            "pass lowering='mpmd' (the SPMD program is one mesh for every rank)"
        )
    if len(meshes) != schedule.num_ranks:
        raise ValueError(
            f"got {len(meshes)} rank meshes for a schedule of {schedule.num_ranks} ranks"
        )
    names = meshes[0].axis_names
    for r, m in enumerate(meshes):
        if m.axis_names != names:
            raise ValueError(
                f"rank {r}'s mesh has axes {m.axis_names}, rank 0's {names}: give every rank "
                "the same axes (jpipe.make_rank_meshes)"
            )
        if m.shape.get(pipe_axis, 1) != 1:
            raise ValueError(
                f"rank {r}'s mesh has a {pipe_axis!r} axis of {m.shape[pipe_axis]}; a rank's "
                "own mesh has one row of it"
            )
        for axis in (data_axis, fsdp_axis):
            if m.shape.get(axis, 1) != meshes[0].shape.get(axis, 1):
                raise ValueError(
                    f"rank {r}'s mesh has {axis}={m.shape.get(axis, 1)}, rank 0's "
                    f"{meshes[0].shape.get(axis, 1)}: ranks may differ in their model axes "
                    f"(tensor) and devices, not (yet) in how the batch is split ({data_axis}, "
                    f"{fsdp_axis})"
                )
    seen: dict = {}
    for r, m in enumerate(meshes):
        for d in m.devices.flat:
            if d in seen:
                raise ValueError(f"device {d} is in the meshes of ranks {seen[d]} and {r}")
            seen[d] = r
    return meshes


def _host_grid(devices, sizes: dict[str, int], across_hosts: dict[str, int]):
    """Devices in an array of shape `sizes`, each axis across ``across_hosts[axis]`` hosts."""
    import numpy as np

    unknown = set(across_hosts) - set(sizes)
    if unknown:
        raise ValueError(
            f"across_hosts names {sorted(unknown)}, which are not mesh axes {tuple(sizes)}"
        )
    hosts: dict[int, list] = {}
    for d in sorted(devices, key=lambda d: (d.process_index, d.id)):
        hosts.setdefault(d.process_index, []).append(d)
    per_host = {p: len(ds) for p, ds in hosts.items()}
    if len(set(per_host.values())) != 1:
        raise ValueError(f"hosts hold different numbers of the devices: {per_host}")
    across, within = [], []
    for axis, size in sizes.items():
        a = across_hosts.get(axis, 1)
        if a < 1 or size % a:
            raise ValueError(
                f"the {axis!r} axis of size {size} cannot span {a} hosts "
                f"(the number of hosts must divide it)"
            )
        across.append(a)
        within.append(size // a)
    n_hosts, n_local = len(hosts), next(iter(per_host.values()))
    if math.prod(across) != n_hosts or math.prod(within) != n_local:
        raise ValueError(
            f"across_hosts={across_hosts} puts {dict(zip(sizes, across))} hosts x "
            f"{dict(zip(sizes, within))} devices per host on the axes, but there are "
            f"{n_hosts} hosts with {n_local} devices each"
        )
    flat = np.array([d for p in sorted(hosts) for d in hosts[p]])
    n = len(sizes)
    grid = flat.reshape(tuple(across) + tuple(within))  # hosts major, as in the hybrid mesh
    order = [k for i in range(n) for k in (i, n + i)]  # (across_0, within_0, across_1, ...)
    return grid.transpose(order).reshape(tuple(sizes.values()))


def _auto(mesh: Mesh) -> Mesh:
    if all(t == AxisType.Auto for t in mesh.axis_types):
        return mesh
    return Mesh(mesh.devices, mesh.axis_names, axis_types=(AxisType.Auto,) * len(mesh.axis_names))


def _check_carries(carries, schedule: Schedule, kind: LoweringKind, num_stages: int):
    """`Pipeline`'s `carries` as a tuple (None without any), refused where they cannot run."""
    name = schedule.name or "the schedule"
    if schedule.slices and kind.one_program:
        raise ValueError(
            f"{name} cuts each sequence into {schedule.num_slices} slices (Seq1F1B); the "
            "SPMD program does not run sequence slices yet: use lowering='mpmd'"
        )
    if carries is None:
        return None
    if not schedule.slices:
        raise ValueError(
            f"carries are carried from one slice of a sequence to the next, but {name} "
            "does not slice its sequences (jpipe.Schedule.of(..., slices=k))"
        )
    carries = tuple(carries)
    if len(carries) != num_stages:
        raise ValueError(f"got {len(carries)} carries for {num_stages} stages (None: no carry)")
    return carries


def run_stages(stages: Sequence[Callable], params_list, inputs):
    """Every stage in order on `inputs`: the model without a pipeline.

    ``x = stage(params, x, inputs)`` from ``x = None``; the last stage's output
    (the loss) is returned.
    """
    if len(params_list) != len(stages):
        raise ValueError(f"got {len(params_list)} stage parameter trees for {len(stages)} stages")
    x = None
    for stage, params in zip(stages, params_list, strict=True):
        x = stage(params, x, inputs)
    return x


class Pipeline:
    """A model, a schedule and a mesh, ready to compute loss and gradients.

    Args:
      stages: the stage functions ``stage(params, x, inputs) -> y`` in order;
        the first gets ``x=None``, the last returns its microbatch's mean loss
        (the step's loss is then the mean over microbatches), or a
        `jpipe.WeightedLoss` ``(total, weight)`` (the step's loss is then
        ``sum(total) / sum(weight)``, e.g. a token-masked mean of the batch).
        The loss is a float scalar (each of the two, for a weighted one) and
        every leaf a stage passes to the next is floating point; both
        lowerings refuse a stage that breaks this before compiling, with the
        same `ValueError` naming the stage (`jpipe.stage.contract`).
      schedule: a `jpipe.Schedule` with one stage per function.
      mesh: a mesh with a ``pipe`` axis of the schedule's rank count, and
        any others (`jpipe.make_mesh`); or, under ``lowering="mpmd"``, one
        mesh per rank (`jpipe.make_rank_meshes`), each with the same axes
        (``pipe`` of size 1) and the same ``data`` and ``fsdp`` sizes but
        its own ``tensor`` size and devices: a rank of tensor 1 beside ranks
        of tensor 2, or of different device kinds. Parameters are then one
        dict per rank (`pack`), and so are the gradients. The program is manual over every
        axis: each device holds its block of the stages' arrays as their
        specs say (`pack`), and the stage functions write the collectives of
        axes other than ``pipe``, ``data`` and ``fsdp`` themselves, with
        plain JAX as under `jax.shard_map` (the stages are traced under its
        rules for varying values, so the gradients are JAX's own; see
        `jpipe.stage.manual` for what a stage receives and must return). A
        collective over ``pipe`` is refused.
      pipe_axis, data_axis: the mesh axis names.
      fsdp_axis: a mesh axis (if the mesh has it) that shards the batch's
        rows, like ``data``, and also every parameter, gradient and
        optimizer state (ZeRO-3; see `jpipe.stage.pack`).
      tick_layout: how pieces are laid out in lock-step ticks: ``"unit"`` (one
        piece per rank per tick, following the unit-cost timeline),
        ``"packed"`` (up to one F, one I and one W per rank per tick: fewer
        ticks, but a transfer still costs one) or ``"auto"`` (the default:
        packed where that does not lengthen the critical path). See
        `jpipe.make_tick_plan`.
      control: the shape of each tick's conditionals: ``"cond"`` (a
        two-way cond around a switch over the stage classes for W, F and I
        a cond per class: ``2 classes + 2`` a tick), ``"switch"`` (one
        switch per piece kind, 3 a tick, for an XLA that updates buffers in
        place through a switch) or ``"auto"`` (the default: the switch where
        the devices' XLA keeps buffers in place through one, measured once
        per platform by `jpipe.lower.spmd.program.switch_writes_in_place`). Same results.
      all_idle: for diagnostics only: a program that runs no piece in any
        tick, so that timing it measures the cost of the pipeline's control
        and transfers alone. Its loss and gradients are zeros.
      lowering: ``"spmd"`` (the default: the whole step one program that
        every device runs in lock step, `jpipe.lower.spmd.program`; it can sit inside a
        user's own `jax.jit`, be differentiated through, and suits TPUs) or
        ``"mpmd"`` (per rank: each piece its own program on its rank's
        devices, issued from the host in the schedule's order, with no
        conditionals and each rank holding only its own values,
        `jpipe.lower.mpmd.programs`; for GPUs and mixed devices). Same loss and gradients.
        The per-rank lowering has no `step_fn` and no `lower`: it is not one
        traceable function.
      carries: for a sliced schedule (`jpipe.Schedule.slices`, Seq1F1B), per
        stage the shape structs of what it carries from one slice of a
        sequence to the next (one slice's, as one device sees it), or None
        for a stage without a carry. A carried stage is
        ``stage(params, x, inputs, carry) -> (y, carry)`` and its sequence's
        first slice gets zeros (`jpipe.stage.carry`). Each leaf of the batch
        has the tokens on its second axis: a slice's inputs are its tokens'
        (a stage that needs its slice's place reads it from the batch, e.g.
        a ``positions`` leaf). The per-rank lowering runs sliced schedules
        of even slices; the SPMD program not yet.
    """

    def __init__(
        self,
        stages: Sequence[Callable],
        schedule: Schedule,
        mesh: Mesh,
        *,
        pipe_axis: str = "pipe",
        data_axis: str = "data",
        fsdp_axis: str = "fsdp",
        tick_layout: str = "auto",
        control: str = "auto",
        all_idle: bool = False,
        lowering: str = "spmd",
        carries: Sequence | None = None,
    ):
        info = analyze(schedule)
        if control not in CONTROLS:
            raise ValueError(f"control must be one of {', '.join(CONTROLS)}; got {control!r}")
        kind = lowering_kind(lowering)
        self.carries = _check_carries(carries, schedule, kind, len(stages))
        if all_idle and not kind.one_program:
            raise ValueError(
                "all_idle measures the SPMD program's control; it has no per-rank form"
            )
        check_tick_layout(tick_layout)  # the per-rank lowering makes its plan only if asked
        self.lowering = kind.name
        self.lowering_kind = kind
        self.control = control
        self.all_idle = all_idle
        self.stages = tuple(stages)
        self.schedule = schedule
        # One mesh per rank, of its own shape (`rank_meshes`), or one mesh for all.
        self.rank_meshes: tuple[Mesh, ...] | None = None
        if not isinstance(mesh, Mesh):
            self.rank_meshes = _check_rank_meshes(
                mesh, schedule, kind, pipe_axis, data_axis, fsdp_axis
            )
            mesh = self.rank_meshes[0]  # its axis names and batch sizes are every rank's
        self.mesh = _auto(mesh)
        self.pipe_axis = pipe_axis
        self.data_axis = data_axis if data_axis in mesh.axis_names else None
        # An fsdp axis of size 1 splits nothing: the batch and the arrays are as without one.
        self.fsdp_axis = fsdp_axis if mesh.shape.get(fsdp_axis, 1) > 1 else None
        if pipe_axis not in mesh.axis_names:
            raise ValueError(f"the mesh has no {pipe_axis!r} axis (it has {mesh.axis_names})")
        R = len(self.rank_meshes) if self.rank_meshes else mesh.shape[pipe_axis]
        if schedule.num_ranks != R:
            raise ValueError(
                f"the schedule has {schedule.num_ranks} ranks but the mesh's {pipe_axis!r} "
                f"axis has {R} devices"
            )
        if info.num_stages != len(self.stages):
            raise ValueError(
                f"the schedule has {info.num_stages} stages but the model has "
                f"{len(self.stages)} stage functions"
            )
        self.num_microbatches = info.num_microbatches
        self.stage_to_rank = info.stage_to_rank
        self.stage_ranks = schedule.stage_ranks  # several ranks for a replicated stage
        self.layout: ParamLayout | None = None
        self._specs = None
        # The stages' traced pieces, once per batch shape (the key of `_key`).
        self._kernels_cache: dict[tuple, list] = {}
        self.compile_seconds: float | None = None
        # The step itself is the lowering's (`jpipe.lower.interface`).
        self._lowering: Lowering = kind.runtime_class()(self, tick_layout)

    @property
    def tick_plan(self):
        """The lock-step tick plan (`jpipe.TickPlan`): under SPMD the one its program runs,
        memory actions included; per rank, of the schedule's compute, for figures."""
        return self._lowering.tick_plan

    @property
    def forward_tick_plan(self):
        """The tick plan of the forwards alone, which `loss` runs under SPMD."""
        return self._lowering.forward_tick_plan

    # -- parameters ------------------------------------------------------------

    def _inner_axes(self, mesh: Mesh) -> dict[str, int]:
        """The sizes of `mesh`'s axes that may split parameters (all but pipe and data)."""
        return {a: n for a, n in mesh.shape.items() if a not in (self.pipe_axis, self.data_axis)}

    def _layout_for(self, params_list, specs=None) -> ParamLayout:
        if len(params_list) != len(self.stages):
            raise ValueError(
                f"got parameters for {len(params_list)} stages, the model has {len(self.stages)}"
            )
        if specs is None and self.layout is not None:
            specs = self._specs
        inner_axes = self._inner_axes(self.mesh)
        layout = ParamLayout.of(
            params_list,
            self.stage_to_rank,
            self.schedule.num_ranks,
            specs=specs,
            axis_sizes=inner_axes,
            fsdp_axis=self.fsdp_axis,
            stage_ranks=self.stage_ranks,
        )
        for m in self.rank_meshes or ():
            layout.on_axes(self._inner_axes(m))  # every rank's mesh splits the arrays it holds
        if self.layout is None:
            self.layout, self._specs = layout, specs
        elif layout != self.layout:
            raise ValueError(
                "these parameters do not have the structure this pipeline was packed with"
            )
        return layout

    def pack(self, params_list, specs=None) -> dict:
        """Places each stage's parameters on its rank: ``{bucket: Array [R, ...]}``.

        See `jpipe.stage.pack` for the buckets; `unpack` gives the per-stage pytrees back.

        Args:
          params_list: one parameter pytree per stage.
          specs: optional, how to split each array over the mesh's other axes
            (``tensor``, ``fsdp``): one pytree per stage like its parameters,
            with a `jax.sharding.PartitionSpec` or None per array (e.g.
            `jpipe.models.gpt.tensor_specs`). Given once, it holds for
            every later call. The program keeps the arrays split this way
            inside every stage.
        """
        layout = self._layout_for(params_list, specs)
        if self.rank_meshes is not None:
            return self._pack_per_rank(layout, params_list)
        return layout.pack(params_list, self.mesh, self.pipe_axis)

    def _pack_per_rank(self, layout: ParamLayout, params_list) -> list[dict | None]:
        """Each rank's own buckets, ``{bucket: Array [1, *row]}`` on its own mesh.

        None for the ranks of other processes (their stages are only read where
        their devices are, so they may be shape structs here).
        """
        shardings = self.param_sharding
        here = jax.process_index()
        out = []
        for r, mesh in enumerate(self.rank_meshes):
            if not any(d.process_index == here for d in mesh.devices.flat):
                out.append(None)
                continue
            rows = {}
            for s, stage_params in enumerate(params_list):
                if r not in layout.stage_ranks[s]:
                    continue
                for leaf, (name, _, _) in zip(jax.tree.leaves(stage_params), layout.leaves[s]):
                    row = np.asarray(leaf).reshape((1,) + layout.buckets[name][0])
                    rows[name] = jax.device_put(row, shardings[r][name])
            out.append({b: rows[b] for b in layout.rank_buckets(r)})
        return out

    def packed_shapes(self, params_list, specs=None) -> dict:
        """What `pack` would give, as shapes: ``{bucket: ShapeDtypeStruct [R, ...]}``.

        `params_list` may hold arrays or `jax.ShapeDtypeStruct`s (e.g. from
        ``jax.eval_shape(model.init, key)``), and each result carries its
        sharding, so ``jax.jit(pipeline.step_fn(batch)).lower(shapes, batch)``
        compiles a model too big for this machine without making any array,
        and its ``memory_analysis()`` gives what each device would hold.
        """
        self._one_mesh("Pipeline.packed_shapes")
        layout = self._layout_for(params_list, specs)
        shardings = layout.sharding(self.mesh, self.pipe_axis)
        return {
            name: jax.ShapeDtypeStruct((layout.num_ranks,) + shape, dtype, sharding=shardings[name])
            for name, (shape, dtype) in layout.buckets.items()
        }

    def init(self, init_fn: Callable, rng, specs=None) -> dict:
        """Makes the packed parameters where they live: ``{bucket: Array [R, ...]}``.

        No device or host ever holds the whole model: for each rank, one
        jitted program on that rank's devices computes only its stages'
        parameters, with each device's output its own block (split over
        ``fsdp`` and ``tensor`` as `pack` would split them), and the blocks
        become the packed arrays in place. A process runs the programs of
        the ranks its devices belong to. `init_programs` gives the programs,
        to read what they allocate.

        Args:
          init_fn: ``init_fn(rng, stages) -> params_list``: every stage's
            parameters, computing only those of `stages` (a set of stage
            indices; the others may come back as shape structs), as
            `jpipe.models.StagedModel.init` does.
          rng: a JAX key.
          specs: as for `pack`.

        With one mesh per rank (`rank_meshes`), the result is one dict per
        rank of its own buckets, ``{bucket: Array [1, ...]}``, as `pack` gives.
        """
        if self.rank_meshes is not None:
            here = jax.process_index()
            return [
                program(rng) if any(d.process_index == here for d in m.devices.flat) else None
                for program, m in zip(
                    self.init_programs(init_fn, rng, specs), self.rank_meshes, strict=True
                )
            ]
        packed_parts: dict[str, list] = {}
        here = jax.process_index()
        for r, program in enumerate(self.init_programs(init_fn, rng, specs)):
            if not any(d.process_index == here for d in self.mesh.devices[r].flat):
                continue
            for name, array in program(rng).items():
                packed_parts.setdefault(name, []).extend(array.addressable_shards)
        shardings = self.param_sharding
        out = {}
        for name, (row, _) in self.layout.buckets.items():
            shape = (self.schedule.num_ranks,) + tuple(row)
            by_device = {shard.device: shard.data for shard in packed_parts[name]}
            devices = shardings[name].addressable_devices_indices_map(shape)
            out[name] = jax.make_array_from_single_device_arrays(
                shape, shardings[name], [by_device[d] for d in devices]
            )
        return out

    def init_programs(self, init_fn: Callable, rng, specs=None) -> list:
        """Per rank, the jitted ``rng -> {bucket: Array [1, ...]}`` that `init` runs on its devices.

        Each is jitted on a mesh of the rank's devices alone, its outputs split
        as the rank's blocks of the packed arrays; ``.lower(rng).compile()``
        and ``memory_analysis()`` tell what each device allocates to make them.
        """
        shapes = jax.eval_shape(lambda k: init_fn(k, None), rng)
        layout = self._layout_for(shapes, specs)
        names = self.mesh.axis_names
        pipe = names.index(self.pipe_axis)
        stages_of = [set() for _ in range(self.schedule.num_ranks)]
        for s, ranks in enumerate(self.stage_ranks):
            for r in ranks:
                stages_of[r].add(s)
        programs = []
        for r in range(self.schedule.num_ranks):
            if self.rank_meshes is not None:  # its own mesh, its own buckets only
                rank_mesh, own = self.rank_meshes[r], layout.rank_buckets(r)
            else:
                rank_mesh = Mesh(
                    self.mesh.devices.take([r], axis=pipe),
                    names,
                    axis_types=(AxisType.Auto,) * len(names),
                )
                own = tuple(layout.buckets)
            out_shardings = {
                name: NamedSharding(rank_mesh, layout.spec(name, self.pipe_axis)) for name in own
            }

            def make(key, r=r, own=own):
                rows = layout.rank_rows(r, init_fn(key, stages_of[r]))
                return {name: rows[name] for name in own}

            programs.append(jax.jit(make, out_shardings=out_shardings))
        return programs

    def unpack(self, packed: dict) -> list:
        """Per-stage parameter (or gradient) pytrees, as host numpy arrays."""
        if self.layout is None:
            raise ValueError("pack parameters first, so the pipeline knows their layout")
        if self.rank_meshes is not None:  # None for stages whose ranks are other processes'
            layout = self.layout
            # A replicated stage from the first of its ranks here (its copies are equal).
            held = [next((r for r in rs if packed[r] is not None), None) for rs in self.stage_ranks]
            return [
                None
                if r is None
                else jax.tree.unflatten(
                    layout.trees[s],
                    [
                        np.asarray(packed[r][name])[0].reshape(shape)
                        for name, shape, _ in layout.leaves[s]
                    ],
                )
                for s, r in enumerate(held)
            ]
        return self.layout.unpack_host(packed)

    @property
    def param_sharding(self) -> dict | list[dict]:
        """Where `pack` puts each bucket: ``{bucket: NamedSharding}``, a dict per rank with
        `rank_meshes`."""
        if self.layout is None:
            raise ValueError("pack parameters first, so the pipeline knows their layout")
        if self.rank_meshes is not None:
            return [
                {
                    b: NamedSharding(m, self.layout.spec(b, self.pipe_axis))
                    for b in self.layout.rank_buckets(r)
                }
                for r, m in enumerate(self.rank_meshes)
            ]
        return self.layout.sharding(self.mesh, self.pipe_axis)

    @property
    def batch_axes(self) -> tuple[str, ...]:
        """The mesh axes the batch's rows are split over: ``data``, then ``fsdp``."""
        return tuple(a for a in (self.data_axis, self.fsdp_axis) if a is not None)

    @property
    def batch_ways(self) -> int:
        """How many ways the batch's rows are split (data x fsdp)."""
        return math.prod(self.mesh.shape[a] for a in self.batch_axes)

    @property
    def batch_sharding(self) -> NamedSharding:
        """Where the batch goes in: split over the batch axes of the mesh (of the first
        rank, with a mesh per rank); with a mesh per rank across processes, a whole copy
        in each process (`processes_sharding`), which each rank takes its rows from."""
        if self.rank_meshes is not None and jax.process_count() > 1:
            return self.processes_sharding
        axes = self.batch_axes
        return NamedSharding(self.mesh, P(axes) if axes else P())

    @property
    def processes_sharding(self) -> NamedSharding:
        """A value replicated once in each process of the pipeline's devices (on its first
        device there): with a mesh per rank across processes, the batch, the step counter
        and the sums every process needs (the gradients' norm) live on it."""
        meshes = self.rank_meshes or (self.mesh,)
        first = {}
        for m in meshes:
            for d in m.devices.flat:
                if d.process_index not in first or d.id < first[d.process_index].id:
                    first[d.process_index] = d
        devices = np.array([first[p] for p in sorted(first)])
        return NamedSharding(Mesh(devices, ("processes",)), P())

    # -- the step --------------------------------------------------------------

    def check_batch(self, batch) -> None:
        """Refuses a batch the microbatches (and the data axis) do not divide.

        Sliced (k slices), the sequences divide the rows and k the second axis.
        """
        M = self.schedule.num_sequences
        k = self.schedule.num_slices
        D = self.batch_ways
        for path, leaf in jax.tree_util.tree_leaves_with_path(batch):
            n = leaf.shape[0] if leaf.ndim else None
            what = "sequences" if k > 1 else "microbatches"
            if n is None or n % M:
                raise ValueError(
                    f"batch{jax.tree_util.keystr(path)} has {n} rows, which {M} {what} "
                    "do not divide"
                )
            if k > 1 and (leaf.ndim < 2 or leaf.shape[1] % k):
                raise ValueError(
                    f"batch{jax.tree_util.keystr(path)} has shape {tuple(leaf.shape)}: each "
                    f"sequence is cut into {k} slices along the second axis (the tokens), "
                    "which must be there and divide by it"
                )
            if (n // M) % D:
                axes = self.batch_axes
                over = (
                    f"over the {D}-way {axes[0]!r} axis"
                    if len(axes) == 1
                    else f"{D} ways over the {' x '.join(map(repr, axes))} axes"
                )
                raise ValueError(
                    f"batch{jax.tree_util.keystr(path)}: microbatches of {n // M} rows cannot "
                    f"be split {over}"
                )

    def _key(self, batch) -> tuple:
        shapes = jax.tree.map(lambda a: (a.shape, str(a.dtype)), batch)
        return (jax.tree.structure(batch), tuple(jax.tree.leaves(shapes)))

    def _microbatch_shapes(self, batch):
        """One microbatch as one device sees it (its rows of the data and fsdp axes)."""
        D = self.batch_ways
        M, k = self.schedule.num_sequences, self.schedule.num_slices

        def one(a):
            tokens = (a.shape[1] // k,) if k > 1 else ()  # a slice's, sliced
            rest = a.shape[1 + len(tokens) :]
            return jax.ShapeDtypeStruct((a.shape[0] // M // D,) + tokens + rest, a.dtype)

        return jax.tree.map(one, batch)

    def _kernels(self, batch) -> list:
        """The stages' pieces for this batch's shapes, traced once for every step."""
        key = self._key(batch)
        if key not in self._kernels_cache:
            batch_axes = tuple(a for a in (self.data_axis, self.fsdp_axis) if a is not None)
            mesh, layout = self.mesh, self.layout
            if self.rank_meshes is not None:  # each stage as a device of its own rank's mesh
                mesh = [self.rank_meshes[r] for r in self.stage_to_rank]
                layout = [self.layout.on_axes(self._inner_axes(m)) for m in mesh]
            self._kernels_cache[key] = trace_kernels(
                self.stages,
                layout,
                self._microbatch_shapes(batch),
                mesh,
                self.pipe_axis,
                batch_axes,
                self.carries,
            )
        return self._kernels_cache[key]

    def _one_mesh(self, what: str) -> None:
        if self.rank_meshes is not None:
            raise ValueError(
                f"{what} makes the packed [R, ...] arrays of one mesh; this Pipeline has a mesh "
                "per rank, whose parameters are one dict per rank: use Pipeline.pack"
            )

    def _require_packed(self) -> None:
        if self.layout is None:
            raise ValueError("pack parameters first with Pipeline.pack")

    def rank_programs(self, batch):
        """The per-rank lowering's programs for this batch's shapes (`jpipe.RankPrograms`)."""
        return self._lowering.rank_programs(batch)

    def loss(self, packed, batch):
        """The mean loss over microbatches, running only the forwards.

        Each rank runs its forwards in the schedule's order and keeps nothing
        for a backward, so this costs about a third of `value_and_grad`.
        """
        self._require_packed()
        return self._lowering.loss(packed, batch)

    def step_fn(self, batch) -> Callable:
        """The pure, unjitted ``(packed_params, batch) -> (loss, packed_grads)``.

        For composing with an optimizer inside the caller's own `jax.jit`;
        `batch` (arrays or shape structs) fixes the shapes it is built for.
        Only a lowering that makes the step one program has it (SPMD).
        """
        return self._lowering.step_fn(batch)

    def stage_kernels(self, batch) -> list:
        """The F, I and W pieces (`jpipe.StageKernels`) the step runs, per stage.

        For profiling: they are traced for one microbatch as one device sees it.
        """
        return self._lowering.stage_kernels(batch)

    def program(self, batch) -> Program:
        """The lowered plan the step runs, for inspection (`jpipe.Program`).

        Its `classes` say which stages share one branch of the program, its
        `table` what every rank does each tick, and its `arena_rows` how big
        the residual and carry buffers are (in rows of `Program.ROW` elements).
        The per-rank lowering's counterpart is `rank_programs`.
        """
        return self._lowering.program(batch)

    def lower(self, packed, batch):
        """The lowered (not yet compiled) step, for inspection (SPMD)."""
        return self._lowering.lower(packed, batch)

    def compile(self, packed, batch):
        """Compiles the step for these shapes; records `compile_seconds`.

        Under the SPMD lowering, returns the compiled program; under the
        per-rank lowering, compiles every piece (`RankPrograms.compile`) and
        returns the `RankPrograms`. `compiled_memory` reads either.
        """
        start = time.perf_counter()
        compiled = self._lowering.compile(packed, batch)
        self.compile_seconds = time.perf_counter() - start
        return compiled

    def compiled_memory(self, compiled) -> tuple[int, int]:
        """``(temp, arguments)`` bytes per device, from `compile`'s result.

        Under SPMD, the program's (every device runs it). Under the per-rank
        lowering, the largest temp and the largest arguments of any one piece
        (each what one device's program allocates at once; they may be two
        pieces'). Raises `ValueError` before `compile`.
        """
        return self._lowering.compiled_memory(compiled)

    def value_and_grad(self, packed, batch):
        """``(loss, packed_grads)``: the mean loss over microbatches and its gradients."""
        self._require_packed()
        return self._lowering.value_and_grad(packed, batch)


def reference_value_and_grad(
    stages: Sequence[Callable], params_list, batch, num_microbatches: int = 1
):
    """The unpipelined model: `jax.value_and_grad` of the mean microbatch loss.

    Runs the stages one after another on each microbatch (cut as `Pipeline`
    cuts them) and averages; with ``num_microbatches=1`` it is the model on the
    whole batch. A last stage that returns a `jpipe.WeightedLoss` gives
    ``sum(total) / sum(weight)`` over the microbatches, as the pipeline does.
    """

    def loss_fn(params_list):
        losses = jax.lax.map(
            lambda inputs: run_stages(stages, params_list, inputs),
            microbatches(batch, num_microbatches),
        )
        if isinstance(losses, WeightedLoss):
            return jnp.sum(losses.total) / jnp.sum(losses.weight)
        return jnp.mean(losses)

    return jax.value_and_grad(loss_fn)(params_list)
