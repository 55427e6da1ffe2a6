"""Compile only: a config's train step built from shapes, compiled, and each device's bytes.

``python train.py --config=configs/llama3_8b.py --config.compile_only=True
[--config.compile_only_device_memory=A100-80] [--config.lowering=mpmd]``

What MaxText's ``train_compile.py`` does for TPUs, for any jpipe config: the
train step the trainer would run (the same model, schedule, lowering,
optimizer and shardings: `jpipe.train.prepare.build` with
``shapes_only=True``) is built from `jax.ShapeDtypeStruct` s and compiled,
not run. Nothing of the model is made (`jax.eval_shape`), no data is read
(the text corpus's batches are int32 ``[batch_size, seq_len]``; a
``config.data.source`` is asked for its first batch's shapes, `batch_shapes`),
and no ``--workdir``, checkpoint or ``config.init_from`` is touched. On a
host without the mesh's devices, as many CPU devices are faked
(``train.py`` does it, `jpipe.train.use_cpu_devices`), so a 64-device
Llama-3-70B step compiles on a laptop's CPU: for XLA:CPU, whose buffer
assignment is close to, not the same as, a GPU's (docs/scale.md).

Printed: a table (stdout), then, as the last line of stdout, one JSON object::

  {"lowering": "spmd" | "mpmd",
   "devices": [{"device", "rank", "arguments_bytes", "temp_bytes", "total_bytes",
                "predicted_bytes"}, ...],
   "peak_bytes", "compile_seconds", "rank_compile_seconds", "fits",
   "device_memory_bytes", "device_memory", "predicted_by"}

- SPMD (``lowering="spmd"``): one row per device, from the compiled step's
  `memory_analysis()` (one program: every device the same): ``arguments``
  (parameters, optimizer state, the batch) and ``temp``; ``total`` adds the
  outputs that do not reuse a donated argument (`profile.compiled_bytes`).
- Per rank (``lowering="mpmd"``): one row per rank, its devices named
  together. ``arguments`` are the state's and the batch's bytes the
  shardings put on the rank's fullest device; ``temp`` is its account
  (`jpipe.RankPrograms.account`: gradient accumulators, live values and the
  working memory of the piece running, from the op list and the compiled
  pieces) or, if larger, its gradients plus the optimizer update's program
  (compiled here too). It is an account, not one program's analysis: the
  step is many programs issued from the host.
- ``predicted_bytes``: jpipe's byte model for the lowering, from the same
  shapes: the schedule search's `device_bytes` (``"spmd"`` or
  ``"mpmd"``, `jpipe.search.engine`, what ``python -m jpipe.search``
  fits schedules with), its figures taken from this step's pieces: each
  stage's residual, carry and output bytes (`jpipe.StageKernels`), its
  parameters' bytes per device times (weights, gradient accumulator, the
  optimizer state's share), and each stage's largest piece's working memory
  (its F, I and W compiled alone, their temp and outputs, plus the
  activation in and out; under the per-rank lowering, each of its pieces as
  compiled, added to the values a rank holds when that piece starts:
  `StageFigures.working_by_kind`). Under SPMD no gradient output beside the accumulator (the
  search's ``grad_output``): the train step feeds its gradients to the
  optimizer's update inside the same program, which writes the donated
  state in place, so no output of the step holds them (counting them put
  Llama-3-8B's prediction 10.8% over the compiled bytes). Known to leave
  out what the model does not count: the padding rows of the packed
  buckets (every device holds the fullest rank's arrays), the batch. None
  (JSON null), with the reason on stderr, where the figures cannot be made
  (a model whose pieces do not compile alone) or with
  ``config.compile_only_predict=False`` (under SPMD the pieces compiled
  alone take about as long again as the step).
- ``compile_seconds``: the wall time of the compile (per rank: of every
  piece and the update's program, one after the other); the predictor's own
  piece compiles are not in it.
- ``rank_compile_seconds``: per rank, the seconds its own pieces took to
  lower and compile (`RankPrograms.rank_compile_seconds`), what each process
  compiles where every rank has a process of its own (the processes compile
  side by side); null under SPMD, where every process compiles the one program.
- ``fits``: every device's total within ``config.compile_only_device_memory``
  (bytes, ``"80GB"``, or a device kind of jpipe's planner such as
  ``"A100-80"``; default 80 GB = 80e9 bytes). `run` returns 0 when it fits,
  1 when not (after one line on stderr naming the fullest device and its
  bytes).
"""

from __future__ import annotations

import collections
import json
import math
import sys
import time
from collections.abc import Callable, Mapping
from typing import NamedTuple

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jpipe
from jpipe.lower.interface import lowering_kind
from jpipe.train.config import TrainConfig, device_memory_bytes
from jpipe.train.prepare import Built, batch_shapes, build, check_row_keys, prepare
from jpipe.train.profile import compiled_bytes
from jpipe.train.step import PerRankTrainStep, compile_train_step, with_row_keys


class DeviceRow(NamedTuple):
    """One device's (SPMD) or one rank's (per-rank lowering) bytes; see the module docstring."""

    device: str
    rank: int
    arguments_bytes: int
    temp_bytes: int
    total_bytes: int
    predicted_bytes: int | None


class Report(NamedTuple):
    """What `compile_only` found; `to_json` is the JSON line `run` prints last."""

    lowering: str
    devices: list[DeviceRow]
    peak_bytes: int
    compile_seconds: float
    fits: bool
    device_memory_bytes: float
    device_memory: str
    predicted_by: str | None
    platform: str
    mesh: str
    rank_compile_seconds: tuple[float | None, ...] | None = None

    def to_json(self) -> dict:
        return {
            "lowering": self.lowering,
            "devices": [row._asdict() for row in self.devices],
            "peak_bytes": self.peak_bytes,
            "compile_seconds": round(self.compile_seconds, 3),
            "rank_compile_seconds": None
            if self.rank_compile_seconds is None
            else [None if t is None else round(t, 3) for t in self.rank_compile_seconds],
            "fits": self.fits,
            "device_memory_bytes": self.device_memory_bytes,
            "device_memory": self.device_memory,
            "predicted_by": self.predicted_by,
        }

    @property
    def fullest(self) -> DeviceRow:
        """The row with the most bytes (the first, if several)."""
        return max(self.devices, key=lambda r: r.total_bytes)


class _NotAsked(Exception):
    """The config asked for no prediction."""


def _stderr(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def compile_only(
    config: ml_collections.ConfigDict | Mapping | TrainConfig,
    devices=None,
    *,
    log: Callable[[str], None] = _stderr,
) -> Report:
    """Builds `config`'s train step from shapes, compiles it and reads each device's bytes.

    Args:
      config: a ConfigDict such as ``configs/default.py``'s, or a `TrainConfig`.
      devices: the devices of the mesh; default `jax.devices()`, or the CPU's
        (faked, `jpipe.train.use_cpu_devices`) when the default backend has
        fewer than the mesh needs.
      log: where progress goes (before each long compile).

    Raises:
      ConfigError: a bad config value, as `jpipe.train.prepare` refuses it.
    """
    c = config if isinstance(config, TrainConfig) else TrainConfig.from_config(config)
    memory, memory_label = device_memory_bytes(c.compile_only_device_memory)
    if devices is None:
        devices = jax.devices()
        if len(devices) < c.mesh.size:  # e.g. a GPU host with fewer than the mesh: fake them
            devices = jax.devices("cpu")
        devices = sorted(devices, key=lambda d: (d.process_index, d.id))
    prepared = prepare(c, devices, shapes_only=True)
    check_row_keys(prepared)
    built = build(prepared, shapes_only=True)
    pipeline = built.pipeline
    batch = batch_shapes(prepared, pipeline.batch_sharding)
    keys_seed = c.seed if prepared.model.keys else None
    keyed = batch
    if keys_seed is not None:
        keyed = jax.eval_shape(lambda b: with_row_keys(b, keys_seed, 0), batch)
    used = [d for m in _meshes(pipeline) for d in m.devices.flat]
    platform = "/".join(sorted({d.platform for d in used}))
    mesh_text = _mesh_text(c)
    log(
        f"compile-only: building the train step from shapes: {c.model_name} "
        f"({_count(pipeline.layout.padding['model'])} parameters), schedule {c.schedule}, "
        f"M={c.num_microbatches}, mesh {mesh_text}, lowering {c.lowering}, "
        f"{jpipe.describe_devices(used)}"
    )
    what = (
        "the train step (one program)"
        if lowering_kind(c.lowering).one_program
        else "every piece of the per-rank lowering and the optimizer update"
    )
    log(f"compile-only: compiling {what} ... (a large model takes minutes)")
    start = time.perf_counter()
    step = compile_train_step(
        pipeline,
        built.optimizer,
        built.lr,
        built.state,
        batch,
        keys_seed,
        c.optimizer.shard_over_data,
    )
    if isinstance(step, PerRankTrainStep):
        updates = _compile_updates(step, built)
        seconds = time.perf_counter() - start
        rows = _rank_rows(pipeline, built, batch, keyed, updates)
        rank_seconds = tuple(pipeline.rank_programs(keyed).rank_compile_seconds())
    else:
        seconds = time.perf_counter() - start
        rows = _device_rows(pipeline, step.memory_analysis())
        rank_seconds = None
    most = max(row.total_bytes for row in rows)
    log(f"compile-only: compiled in {seconds:.1f} s: {_gb(most)} on the fullest device")
    predicted, predicted_by = None, None
    try:
        if not c.compile_only_predict:
            raise _NotAsked("config.compile_only_predict=False")
        predicted = _predicted(pipeline, built, keyed, log)
        predicted_by = (
            f"jpipe.search.engine.device_bytes (layout "
            f"{lowering_kind(c.lowering).layout}) on figures from this step's "
            "pieces"
        )
    except _NotAsked as e:
        log(f"compile-only: no prediction ({e})")
    except Exception as e:  # noqa: BLE001 (a model the predictor cannot take: say so, no figure)
        log(f"compile-only: no prediction: jpipe's byte model could not take this model ({e})")
    if predicted is not None:
        rows = [row._replace(predicted_bytes=int(predicted[row.rank])) for row in rows]
    return Report(
        lowering=c.lowering,
        devices=rows,
        peak_bytes=most,
        compile_seconds=seconds,
        fits=all(row.total_bytes <= memory for row in rows),
        device_memory_bytes=memory,
        device_memory=memory_label,
        predicted_by=predicted_by,
        platform=platform,
        mesh=mesh_text,
        rank_compile_seconds=rank_seconds,
    )


def run(
    config: ml_collections.ConfigDict | Mapping | TrainConfig,
    devices=None,
    *,
    out=None,
    log: Callable[[str], None] = _stderr,
) -> int:
    """`compile_only`, printed: the table, then the JSON line (last on `out`, default stdout).

    Returns:
      0 when every device fits ``config.compile_only_device_memory``, 1 when
      one does not (one line on stderr names the fullest device and its bytes).
    """
    out = out or sys.stdout
    report = compile_only(config, devices, log=log)
    print(table(report), file=out)
    print(json.dumps(report.to_json()), file=out, flush=True)
    if report.fits:
        return 0
    worst = report.fullest
    if lowering_kind(report.lowering).one_program:  # a row per device
        where = f"device {worst.device} (rank {worst.rank})"
    else:  # a row per rank
        where = f"rank {worst.rank} ({worst.device})"
    log(
        f"error: {where} needs {worst.total_bytes:,} bytes ({_gb(worst.total_bytes)}), over the "
        f"{report.device_memory} device memory of {report.device_memory_bytes:,.0f} bytes "
        f"({_gb(report.device_memory_bytes)})"
    )
    return 1


def table(report: Report) -> str:
    """The report as a table, one row per device (SPMD) or per rank (per-rank lowering)."""
    unit = _unit(report.peak_bytes)
    per_device = lowering_kind(report.lowering).one_program  # else a row per rank
    first = "device" if per_device else "devices"
    width = max(len(first), *(len(r.device) for r in report.devices))
    cols = ("arguments", "temp", "total", "predicted")
    lines = [
        f"compile-only: lowering {report.lowering}, mesh {report.mesh}, "
        f"{len(report.devices)} {'devices' if per_device else 'ranks'} "
        f"({report.platform}); bytes in {unit[0]}; device memory {report.device_memory} "
        f"= {_in(report.device_memory_bytes, _unit(report.device_memory_bytes))}",
        f"{first:<{width}}  rank " + " ".join(f"{c:>10}" for c in cols) + "  fits",
    ]
    for r in report.devices:
        predicted = "-" if r.predicted_bytes is None else _in(r.predicted_bytes, unit, False)
        figures = (
            _in(r.arguments_bytes, unit, False),
            _in(r.temp_bytes, unit, False),
            _in(r.total_bytes, unit, False),
            predicted,
        )
        fits = "yes" if r.total_bytes <= report.device_memory_bytes else "NO"
        lines.append(
            f"{r.device:<{width}}  {r.rank:>4} "
            + " ".join(f"{f:>10}" for f in figures)
            + f"  {fits}"
        )
    verdict = "fits" if report.fits else "does NOT fit"
    lines.append(
        f"peak {_in(report.peak_bytes, unit)} a device of "
        f"{_in(report.device_memory_bytes, _unit(report.device_memory_bytes))}: "
        f"{verdict}; compiled in {report.compile_seconds:.1f} s"
        + _slowest_rank(report.rank_compile_seconds)
        + ("" if report.predicted_by else "; predicted: none (see stderr)")
    )
    return "\n".join(lines)


def _slowest_rank(seconds) -> str:
    """Where each rank's pieces were timed: the slowest rank's, what a process of its own
    would compile."""
    known = [(t, r) for r, t in enumerate(seconds or ()) if t is not None]
    if not known:
        return ""
    t, r = max(known)
    return f" (rank {r}'s pieces {t:.1f} s: what a process a rank compiles)"


# -- the rows ----------------------------------------------------------------------------------


def _meshes(pipeline: jpipe.Pipeline) -> list:
    return list(pipeline.rank_meshes) if pipeline.rank_meshes is not None else [pipeline.mesh]


def _device_name(d) -> str:
    return f"{d.platform}:{d.id}"


def _devices_name(devices) -> str:
    """``"cpu:0-7"`` for consecutive ids of one platform, else ``"cpu:0,cpu:2"``."""
    ids = [d.id for d in devices]
    kinds = {d.platform for d in devices}
    if len(devices) > 2 and len(kinds) == 1 and ids == list(range(ids[0], ids[0] + len(ids))):
        return f"{kinds.pop()}:{ids[0]}-{ids[-1]}"
    return ",".join(_device_name(d) for d in devices)


def _device_rows(pipeline: jpipe.Pipeline, memory) -> list[DeviceRow]:
    """The SPMD program's bytes, one row per device (the same program on each)."""
    mesh = pipeline.mesh
    pipe = mesh.axis_names.index(pipeline.pipe_axis)
    rows = []
    for index, d in np.ndenumerate(mesh.devices):
        rows.append(
            DeviceRow(
                _device_name(d),
                int(index[pipe]),
                int(memory.argument_size_in_bytes),
                int(memory.temp_size_in_bytes),
                int(compiled_bytes(memory)),
                None,
            )
        )
    return sorted(rows, key=lambda r: r.rank)  # stable: each rank's devices in mesh order


def _held(tree) -> collections.Counter:
    """Bytes per device of these sharded shape structs (each device's blocks)."""
    held: collections.Counter = collections.Counter()
    for leaf in jax.tree.leaves(tree):
        if leaf is None or getattr(leaf, "sharding", None) is None:
            continue
        item = np.dtype(leaf.dtype).itemsize
        shape = tuple(leaf.shape)
        for device, index in leaf.sharding.devices_indices_map(shape).items():
            held[device] += item * math.prod(
                len(range(*s.indices(n))) for s, n in zip(index, shape)
            )
    return held


def _rank_devices(pipeline: jpipe.Pipeline) -> list[list]:
    if pipeline.rank_meshes is not None:
        return [list(m.devices.flat) for m in pipeline.rank_meshes]
    mesh = pipeline.mesh
    pipe = mesh.axis_names.index(pipeline.pipe_axis)
    return [list(np.take(mesh.devices, r, axis=pipe).flat) for r in range(mesh.devices.shape[pipe])]


def _compile_updates(step: PerRankTrainStep, built: Built) -> list[int] | int:
    """Compiles the per-rank step's optimizer update(s); their working bytes per device.

    One program over the whole mesh (its bytes on every device), or with a mesh
    per rank one per rank: temp and the outputs that do not reuse a donated argument.
    """
    pipeline, state = built.pipeline, built.state
    update = step._update  # noqa: SLF001 (the step's own programs, compiled here from shapes)

    def work(compiled) -> int:
        m = compiled.memory_analysis()
        return int(m.temp_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes)

    def grads_of(params, sharding):
        return jax.tree.map(
            lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), params, sharding
        )

    if pipeline.rank_meshes is None:
        loss = jax.ShapeDtypeStruct((), jnp.float32, sharding=NamedSharding(pipeline.mesh, P()))
        grads = grads_of(state.params, pipeline.param_sharding)
        return work(update.lower(state, loss, grads).compile())
    out = []
    for r, fn in enumerate(update._updates):  # noqa: SLF001
        norm = jax.ShapeDtypeStruct(
            (), jnp.float32, sharding=NamedSharding(pipeline.rank_meshes[r], P())
        )
        grads = grads_of(state.params[r], pipeline.param_sharding[r])
        out.append(work(fn.lower(state.params[r], state.opt_state[r], grads, norm).compile()))
    return out


def _rank_rows(pipeline: jpipe.Pipeline, built: Built, batch, keyed, updates) -> list[DeviceRow]:
    """The per-rank lowering's bytes, one row per rank (see the module docstring)."""
    programs = pipeline.rank_programs(keyed)  # what the step compiled (with any dropout keys)
    account = programs.account()
    held = _held((built.state, batch))
    rows = []
    for r, devices in enumerate(_rank_devices(pipeline)):
        if account[r] is None:  # another process's rank
            continue
        arguments = max(held.get(d, 0) for d in devices)
        update = updates if isinstance(updates, int) else updates[r]
        temp = max(account[r].peak_bytes, account[r].grad_bytes + update)
        rows.append(
            DeviceRow(
                _devices_name(devices), r, int(arguments), int(temp), int(arguments + temp), None
            )
        )
    return rows


# -- the byte model ----------------------------------------------------------------------------


def _nbytes(avals) -> int:
    return sum(math.prod(a.shape) * np.dtype(a.dtype).itemsize for a in avals)


def _predicted(pipeline: jpipe.Pipeline, built: Built, keyed, log) -> tuple[float, ...]:
    """Each rank's device bytes as jpipe's byte model for the lowering predicts them."""
    from jpipe.search.engine import device_bytes

    schedule = pipeline.schedule
    kernels = pipeline.stage_kernels(keyed)
    S = schedule.num_stages
    rank_of = pipeline.stage_to_rank
    layout = pipeline.layout
    layouts = [layout] * S
    if pipeline.rank_meshes is not None:
        axes = [
            {a: n for a, n in m.shape.items() if a not in (pipeline.pipe_axis, pipeline.data_axis)}
            for m in pipeline.rank_meshes
        ]
        layouts = [layout.on_axes(axes[rank_of[s]]) for s in range(S)]
    weights = [
        sum(
            math.prod(layouts[s].local_shape(name)) * np.dtype(dtype).itemsize
            for name, _, dtype in layout.leaves[s]
        )
        for s in range(S)
    ]
    # The optimizer's state per byte of weights, as this state holds it per device.
    state = built.state
    param_held, opt_held = _held(state.params), _held(state.opt_state)
    share = max(opt_held.values(), default=0) / max(max(param_held.values(), default=1), 1)
    out = [_nbytes(jax.tree.leaves(k.y)) for k in kernels]
    ins = [_nbytes(jax.tree.leaves(k.x)) if k.has_x else 0 for k in kernels]
    one_program = pipeline.lowering_kind.one_program
    by_kind = None
    if not one_program:  # each piece a program: measure each
        by_kind = _compiled_working(pipeline.rank_programs(keyed), out, ins)
        working = [max(k.values(), default=0) for k in by_kind]
    else:
        log("compile-only: jpipe's byte model: compiling each stage's pieces alone ...")
        working = _spmd_working(pipeline, kernels, pipeline.program(keyed).classes, out, ins, log)
    figures = jpipe.StageFigures(
        sizes=jpipe.Sizes(
            activation=[_nbytes(k.res_avals) for k in kernels],
            carry=[_nbytes(k.carry_avals) for k in kernels],
            params=[w * (2 + share) for w in weights],  # weights, gradients, optimizer state
            input=[0] + out[:-1],
        ),
        working=tuple(float(w) for w in working),
        # Under SPMD: a gradient output beside the accumulator, which the train step has
        # none of (module docstring); per rank: each rank's own gradients, the share of the
        # packed parameters that is its own (`RankBytes.packed_everywhere`).
        grad_output=0.0 if one_program else tuple(float(w) for w in weights),
        num_stages=S,
        working_by_kind=by_kind,
    )
    sim = jpipe.simulate(schedule)
    layout_name = pipeline.lowering_kind.layout
    # Each rank holds only its own parameters where it has a mesh of its own.
    predicted = device_bytes(
        sim, figures, layout_name, packed_everywhere=pipeline.rank_meshes is None
    )
    parts = predicted.parts(predicted.fullest)
    log(
        f"compile-only: jpipe's byte model ({layout_name}), rank {predicted.fullest}: "
        + ", ".join(f"{name} {_in(b, _unit(b))}" for name, b in parts.items())
    )
    return predicted.device


def _compiled_working(programs, out, ins) -> list[dict[str, int]]:
    """Per stage, each issued piece's working memory, plus the activation in and out.

    Per kind of action the schedule issues, as the rank's account counts it:
    a B issued as its I and its W holds the I-to-W carry beside the W
    (`RankPrograms.piece_working_bytes`).
    """
    issued = [set() for _ in range(programs.num_stages)]
    for _, a in programs.order:
        issued[a.stage].add(a.kind)
    here = {s for s, _ in programs.compiled}
    return [
        {k: programs.piece_working_bytes(s, k) + out[s] + ins[s] for k in sorted(issued[s])}
        if s in here
        else {}
        for s in range(programs.num_stages)
    ]


def _spmd_working(pipeline, kernels, classes, out, ins, log) -> list[int]:
    """Per stage, its largest piece's working memory: its F, I and W compiled alone.

    On the first rank's devices of the axes the stages may name collectives
    of (all but ``pipe``, ``data`` and ``fsdp``), under a `jax.shard_map`
    with every argument replicated: each device runs the one-device shapes
    the pieces were traced for. Stages of one class (the same program on the
    same shapes) are compiled once. Plus the stage's activation in and out.
    """
    mesh = pipeline.mesh
    skip = {pipeline.pipe_axis, pipeline.data_axis, pipeline.fsdp_axis}
    inner = [a for a in mesh.axis_names if a not in skip and mesh.shape[a] > 1]
    sub = None
    if inner:
        devices = mesh.devices
        for axis in reversed(range(len(mesh.axis_names))):
            if mesh.axis_names[axis] not in inner:
                devices = np.take(devices, 0, axis=axis)
        sub = jax.sharding.Mesh(devices, tuple(inner))

    def shapes(avals):
        return [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in avals]

    done: dict = {}
    for s, (k, c) in enumerate(zip(kernels, classes)):
        if c in done:
            continue
        log(f"compile-only: byte model: compiling stage {s}'s F, I and W alone ...")
        res, carry = shapes(k.res_avals), shapes(k.carry_avals)
        y = shapes(jax.tree.leaves(k.y))
        pieces = (
            (k.forward, (k.params, k.x, k.inputs)),
            (k.input_grad, (k.params, k.inputs, res, y)),
            (k.weight_grad, (k.params, k.inputs, res, carry)),
        )
        most = 0
        for fn, args in pieces:
            if sub is not None:
                fn = jax.shard_map(fn, mesh=sub, in_specs=P(), out_specs=P(), check_vma=False)
            m = jax.jit(fn).lower(*args).compile().memory_analysis()
            most = max(most, int(m.temp_size_in_bytes + m.output_size_in_bytes))
        done[c] = most
    return [done[c] + out[s] + ins[s] for s, c in enumerate(classes)]


# -- text --------------------------------------------------------------------------------------


def _mesh_text(c: TrainConfig) -> str:
    m = c.mesh
    parts = [f"pipe {m.pipe}"]
    parts += [f"{a} {n}" for a, n in (("data", m.data), ("fsdp", m.fsdp)) if n > 1]
    if m.rank_tensors is not None:
        parts.append(f"tensor per rank {m.tensor_per_rank}")
    elif m.tensor > 1:
        parts.append(f"tensor {m.tensor}")
    return " x ".join(parts)


def _count(n: float) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.2f}M"


def _unit(nbytes: float) -> tuple[str, float]:
    for name, size in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if nbytes >= size:
            return name, size
    return "B", 1.0


def _in(nbytes: float, unit: tuple[str, float], name: bool = True) -> str:
    text = f"{nbytes / unit[1]:,.2f}" if unit[1] > 1 else f"{nbytes:,.0f}"
    return f"{text} {unit[0]}" if name else text


def _gb(nbytes: float) -> str:
    """``"96.39 GB, 89.77 GiB"``; under a GB in the unit that suits it (``"851.79 KB"``)."""
    if nbytes < 1e9:
        return _in(nbytes, _unit(nbytes))
    return f"{nbytes / 1e9:.2f} GB, {nbytes / 2**30:.2f} GiB"
