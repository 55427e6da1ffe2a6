"""Step 4 of a run: build, compile and loop; `train` is what ``train.py`` calls.

The loop dispatches step N before it reads step N-1's metrics, so the host
never waits on the device except to evaluate, to checkpoint (only after
checking the loss) and at the end. Batches come from
`jpipe.train.data.Batches.batch_at(step, ...)`, a pure function of the step,
so a resumed run sees exactly the batches an uninterrupted one would and gives
the same losses, bit for bit. A NaN or infinite loss (or gradient norm) stops
the run with `DivergedError` before any later checkpoint.

Ctrl-C. For the whole of `train` (in the main thread of a one-process
run) SIGINT only raises a flag, which `train` reads at safe points: after
the checkpoints are listed, after the step compiles, after the first
evaluation, between steps (after saving the step's checkpoint) and at the
end; there it raises `Interrupted`. So no `KeyboardInterrupt` is ever
raised inside JAX, XLA or orbax code, or a garbage-collection callback
they run (where one was once swallowed, and once left XLA to crash the
interpreter). A second Ctrl-C ends the process at once (exit status 130)
without raising anything: compiling cannot be stopped any other way, and
an unfinished checkpoint is removed when the next run starts.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import signal
import statistics
import sys
import threading
import time
from collections.abc import Mapping
from typing import NamedTuple

import jax
import jax.numpy as jnp
import ml_collections
from jax.experimental import multihost_utils

import jpipe
from jpipe.models.registry import load_function
from jpipe.planner import save_profile
from jpipe.runtime.distributed import from_process_zero, num_processes
from jpipe.schedule.chart import text_chart
from jpipe.train.agreement import check_agreement
from jpipe.train.checkpoint import Checkpoints, check_resumable, checkpoint_meta
from jpipe.train.config import ConfigError, TrainConfig, config_error
from jpipe.train.data import device_batch
from jpipe.train.metrics import Metrics, mib, say
from jpipe.train.prepare import Prepared, build, check_row_keys, prepare
from jpipe.train.profile import plan_memory_line, print_profile, stage_profile
from jpipe.train.step import (
    TrainState,
    compile_train_step,
    with_row_keys,
)


class DivergedError(FloatingPointError):
    """The loss or the gradient norm became NaN or infinite."""


class Interrupted(KeyboardInterrupt):
    """Ctrl-C (SIGINT) stopped `train` at a safe point.

    Attributes:
      step: the step reached. With `saved`, its checkpoint is in `directory`
        and training again in the same directory resumes from it; without,
        the run stopped before its first step (preparing, compiling or at
        the first evaluation), and training again starts where this call
        started (from the newest checkpoint, if any).
      directory: the checkpoint directory.
      saved: whether this call saved the checkpoint of `step`.
      finished: `step` is ``config.steps``: the run had done all its work
        (the Ctrl-C came during its last step, its checkpoint, or while the
        checkpoints were being closed); nothing is left to resume.
    """

    def __init__(self, step: int, directory: str, saved: bool = True, finished: bool = False):
        if finished:
            text = f"interrupted after the last step ({step}); the run is complete"
        elif saved:
            text = f"interrupted at step {step}; its checkpoint is in {directory}"
        else:
            text = f"interrupted before training on from step {step}; nothing new was saved"
        super().__init__(text)
        self.step = step
        self.directory = directory
        self.saved = saved
        self.finished = finished


class TrainResult(NamedTuple):
    """What a call to `train` did.

    Attributes:
      losses: ``{step: training loss}`` for every step run by this call (step =
        optimizer steps done, from 1; the loss is that step's batch's, before
        its update).
      eval_losses: ``{step: held-out loss}`` for every evaluation of this call.
      start_step: the step this call started from (0, or the checkpoint's).
      final_step: the step it reached.
      wall_seconds: the call's wall time, from start to end.
      step_seconds: the median time of a step, between consecutive steps.
      tokens_per_second: training tokens per second at that median, when the
        data states its tokens per row (the text corpus; a source through
        ``config.data.tokens_per_row`` or its own ``tokens_per_row``), else None.
      rows_per_second: batch rows per second at that median.
      eval_figures: ``{step: {"eval_NAME": value}}``, the means of
        ``config.eval_fn``'s figures at every evaluation (empty without one).
    """

    losses: dict[int, float]
    eval_losses: dict[int, float]
    start_step: int
    final_step: int
    wall_seconds: float
    step_seconds: float | None
    tokens_per_second: float | None
    rows_per_second: float | None = None
    eval_figures: dict[int, dict[str, float]] | None = None


class Run(NamedTuple):
    """What the loop runs: built once, read-only.

    Attributes:
      prepared: the checked config, schedule, mesh and data.
      pipeline: the model, schedule and mesh.
      compiled: the compiled train step ``(state, batch) -> (state, metrics)``.
      checkpoints: the run directory's checkpoints.
      metrics: where records go.
      show_bar: whether to draw the progress bar.
      interrupt: the Ctrl-C flag (`_CtrlC`).
      tokens_per_row: tokens in a batch row, or None when the data does not say.
      eval_fn: ``config.eval_fn``'s function, or None.
    """

    prepared: Prepared
    pipeline: jpipe.Pipeline
    compiled: object
    checkpoints: Checkpoints
    metrics: Metrics
    show_bar: bool
    interrupt: _CtrlC
    tokens_per_row: int | None
    eval_fn: object | None


@dataclasses.dataclass
class LoopState:
    """What the loop changes as it goes.

    Attributes:
      state: the train state (donated to each step).
      losses, eval_losses: what `TrainResult` reports.
      step_times: seconds between consecutive steps' metrics.
      window_seconds, window_steps: time and steps since the bar last showed them.
      clock: when the last step's metrics were read.
    """

    state: TrainState
    losses: dict[int, float] = dataclasses.field(default_factory=dict)
    eval_losses: dict[int, float] = dataclasses.field(default_factory=dict)
    eval_figures: dict[int, dict[str, float]] = dataclasses.field(default_factory=dict)
    step_times: list[float] = dataclasses.field(default_factory=list)
    window_seconds: float = 0.0
    window_steps: int = 0
    clock: float = 0.0


def _due(step: int, every: int) -> bool:
    return every > 0 and step % every == 0


def evaluate(pipeline: jpipe.Pipeline, params: dict, eval_data, batches: int) -> float:
    """Mean held-out loss over `batches` fixed batches."""
    total = 0.0
    for i in range(batches):
        loss = pipeline.loss(params, device_batch(eval_data, i, pipeline.batch_sharding))
        total = total + loss
    return float(total) / batches


def evaluate_fn(
    fn, spec: str, pipeline: jpipe.Pipeline, params, eval_data, batches: int
) -> dict[str, float]:
    """The means of ``fn(stage_params, batch)``'s figures over `batches` held-out batches.

    ``config.eval_fn``'s contract: `fn` gets the model's parameters as its
    `jpipe.models.StagedModel.init` makes them (a list of per-stage
    pytrees, as `jax.Array` s on the default device, gathered from the
    pipeline's packed buckets once per evaluation) and one whole held-out
    batch (a dict of numpy arrays, the global batch: the batches
    `evaluate` reads), and returns ``{name: number}``. Every process runs
    it (on the same batches); process 0 writes the figures, as
    ``eval_NAME``. It runs outside the pipeline, on one device, so it
    suits figures a model of this size can compute whole (accuracy,
    a metric of the outputs); the held-out loss stays the pipeline's.

    Raises:
      ConfigError: `fn` returned something other than a dict of numbers, or
        a figure named ``loss`` (the trainer's own ``eval_loss``).
    """
    packed = params
    if jax.process_count() > 1:  # every process's buckets, gathered to every host
        packed = multihost_utils.process_allgather(params, tiled=True)
    stage_params = jax.tree.map(jnp.asarray, pipeline.unpack(packed))
    totals: dict[str, float] = {}
    for i in range(batches):
        figures = fn(stage_params, eval_data.batch_at(i))
        if not isinstance(figures, Mapping) or not all(isinstance(k, str) for k in figures):
            raise ConfigError(
                f"config.eval_fn={spec!r} returned a {type(figures).__name__}; it must return "
                "a dict of {name: number}"
            )
        for name, value in figures.items():
            if name == "loss":
                raise ConfigError(
                    f"config.eval_fn={spec!r} returned a figure named 'loss', which would be "
                    "written as eval_loss, the trainer's own held-out loss; name it otherwise"
                )
            try:
                number = float(value)
            except (TypeError, ValueError):
                raise ConfigError(
                    f"config.eval_fn={spec!r} returned {name!r}: {value!r}; each figure must be "
                    "a number (a Python or 0-d array scalar)"
                ) from None
            totals[name] = totals.get(name, 0.0) + number
    return {f"eval_{name}": total / batches for name, total in totals.items()}


def make_workdir(workdir: str) -> str:
    """Creates the work directory on process 0; every process returns once it exists.

    In a multi-process run the others wait for process 0's
    answer, so nobody opens the checkpoint manager before the directory is
    there, and all of them fail alike when it cannot be made; each then
    checks that it sees the directory (the hosts must share a filesystem).

    Raises:
      ConfigError: naming ``--workdir``, when the directory cannot be made or seen.
    """
    workdir = os.path.abspath(workdir)
    problem = ""
    if jax.process_index() == 0:
        try:
            os.makedirs(workdir, exist_ok=True)
        except OSError as e:
            problem = e.strerror or str(e)
    problem = from_process_zero("workdir", problem)  # also the barrier
    if problem:
        raise ConfigError(f"--workdir={workdir}: cannot create the directory ({problem})")
    if not os.path.isdir(workdir):
        raise ConfigError(
            f"--workdir={workdir}: process {jax.process_index()} does not see the directory "
            "process 0 created; every host must see the same --workdir (a shared filesystem)"
        )
    return workdir


def train(
    config: ml_collections.ConfigDict | Mapping | TrainConfig,
    workdir: str,
    *,
    progress: bool = True,
) -> TrainResult:
    """Trains from `config`, resuming from the newest checkpoint in `workdir`.

    Args:
      config: a ConfigDict such as ``configs/default.py``'s, or a `TrainConfig`.
      workdir: where checkpoints, ``metrics.jsonl`` and TensorBoard logs go.
      progress: show a progress bar (process 0 only).

    Returns:
      A `TrainResult`.

    Raises:
      ConfigError: a bad config value, or a checkpoint in `workdir` written for
        another model or split; before anything is compiled.
      DivergedError: the loss or gradient norm became NaN or infinite; no
        checkpoint is written after the bad step.
    """
    wall_start = time.perf_counter()
    with _CtrlC() as interrupt:  # Ctrl-C raises a flag from here on (the module docstring)
        prepared = prepare(config)
        check_agreement(prepared)  # every process runs process 0's run, before compiling
        lead = jax.process_index() == 0
        workdir = make_workdir(workdir)
        checkpoints = Checkpoints(os.path.join(workdir, "checkpoints"))
        try:
            result = _run(prepared, workdir, checkpoints, lead, progress, wall_start, interrupt)
        finally:
            if not interrupt.requested:
                interrupt.doing = "writing the last checkpoint"
            checkpoints.close()  # waits for the last save's writes
        # A Ctrl-C while they finished: the run is whole, but it was asked to stop.
        final = result.final_step
        interrupt.check(
            final,
            checkpoints.directory,
            saved=checkpoints.latest_step() == final,
            finished=final >= prepared.config.steps,
        )
        return result


def _run(
    prepared: Prepared,
    workdir: str,
    checkpoints: Checkpoints,
    lead: bool,
    progress: bool,
    wall_start: float,
    interrupt: _CtrlC,
) -> TrainResult:
    c = prepared.config
    removed = checkpoints.remove_incomplete()
    start = checkpoints.latest_step()
    interrupt.check(int(start or 0), checkpoints.directory, saved=False)
    if start is not None:
        check_resumable(checkpoints, start, prepared)  # before anything is compiled
        if start >= c.steps:
            say(
                f"nothing to do: {checkpoints.directory} is at step {start}, config.steps={c.steps}"
            )
            return TrainResult(
                {}, {}, start, start, time.perf_counter() - wall_start, None, None, None, {}
            )

    check_row_keys(prepared)
    eval_fn = _eval_fn(c)
    # Each rank's devices make only that rank's parameters, each device its
    # own block of them (`Pipeline.init`): no device or host holds the model.
    pipeline, optimizer, lr, state = build(prepared)
    if start is not None:
        state = _restore(checkpoints, start, pipeline, prepared, state)
    start = int(start or 0)

    _say_setup(prepared, pipeline)
    batch = device_batch(prepared.train_data, start, pipeline.batch_sharding)
    tokens_per_row = _tokens_per_row(prepared)  # a source's, known from its first batch
    interrupt.check(start, checkpoints.directory, saved=False)
    compiled = _compile_step(prepared, pipeline, optimizer, lr, state, batch, interrupt)
    if c.profile:
        _profile(prepared, pipeline, compiled, state, batch, workdir if lead else None)

    interrupt.check(start, checkpoints.directory, saved=False)
    if removed:
        say(f"removed unfinished checkpoint(s) {removed}")
    if start:
        say(f"resuming from the checkpoint of step {start} in {checkpoints.directory}")
    # Records past the checkpoint are rewritten by this run; a fresh start
    # (no checkpoint) rewrites them all, step 0 included.
    metrics = Metrics(workdir, start if start else -1, lead)
    if lead and metrics.tensorboard_name:
        say(f"TensorBoard ({metrics.tensorboard_name}): {os.path.join(workdir, 'tensorboard')}")

    run = Run(
        prepared,
        pipeline,
        compiled,
        checkpoints,
        metrics,
        lead and progress,
        interrupt,
        tokens_per_row,
        eval_fn,
    )
    loop = LoopState(state)
    try:
        _loop(run, loop, batch, start)
    finally:
        metrics.close()  # its TensorBoard writer's threads end with the run, however it ends
    step_seconds = statistics.median(loop.step_times) if loop.step_times else None
    rows_per_second = c.batch_size / step_seconds if step_seconds else None
    tps = rows_per_second * tokens_per_row if rows_per_second and tokens_per_row else None
    wall = time.perf_counter() - wall_start
    _say_held_out(loop.eval_losses)
    if step_seconds:
        rate = f"{tps:,.0f} tokens/s" if tps else f"{rows_per_second:,.1f} rows/s"
        say(
            f"median step {step_seconds * 1e3:.1f} ms, {rate}; "
            f"wall time {wall:.1f} s; metrics in {metrics.path}"
        )
    final = max(loop.losses) if loop.losses else start
    # Ctrl-C during the last step or its checkpoint: the run is whole, but it was asked to stop.
    interrupt.check(
        final,
        checkpoints.directory,
        saved=checkpoints.latest_step() == final,
        finished=final >= c.steps,
    )
    return TrainResult(
        loop.losses,
        loop.eval_losses,
        start,
        final,
        wall,
        step_seconds,
        tps,
        rows_per_second,
        loop.eval_figures,
    )


def _eval_fn(c: TrainConfig):
    """``config.eval_fn``'s function, or None without one.

    Raises:
      ConfigError: the file or the function is not there, or the run is the
        per-rank lowering's in several processes.
    """
    if not c.eval_fn:
        return None
    if c.rank_tensors is not None and jax.process_count() > 1:
        raise config_error(
            "eval_fn",
            c.eval_fn,
            "runs on every process with the whole model, which a run of the per-rank "
            "lowering in several processes never gathers (each process holds only its own "
            "ranks' parameters); accepted: eval_fn with lowering='spmd', or the per-rank "
            "lowering in one process",
        )
    try:
        return load_function(c.eval_fn, "config.eval_fn")
    except ValueError as e:
        raise ConfigError(str(e)) from None


def _restore(
    checkpoints: Checkpoints, start: int, pipeline: jpipe.Pipeline, prepared: Prepared, state
) -> TrainState:
    """The train state of the checkpoint of step `start`, into `state`'s places.

    Raises:
      ConfigError: the checkpoint packs the parameters into other buckets.
    """
    buckets = checkpoints.metadata(start).get("buckets")
    if buckets != checkpoint_meta(pipeline, prepared)["buckets"]:
        raise ConfigError(
            f"the checkpoint of step {start} in {checkpoints.directory} packs the parameters "
            "into other buckets (written by another version of jpipe?); give a new --workdir"
        )
    return checkpoints.restore(start, state)


def _say_setup(prepared: Prepared, pipeline: jpipe.Pipeline) -> None:
    """What a person sees before the first step: devices, mesh, model and the schedule's chart."""
    c, schedule, mesh = prepared.config, prepared.schedule, prepared.mesh
    sim = jpipe.simulate(schedule)
    processes = f" in {jax.process_count()} processes" if jax.process_count() > 1 else ""
    meshes = mesh if isinstance(mesh, list) else [mesh]
    if c.mesh.rank_tensors:
        tensor = f"tensor per rank {c.mesh.tensor_per_rank} (a mesh per rank)"
    else:
        tensor = f"tensor={c.mesh.tensor}" + (" (a mesh per rank)" if c.rank_tensors else "")
    say(
        f"devices: {jpipe.describe_devices([d for m in meshes for d in m.devices.flat])}"
        f"{processes}; mesh pipe={c.mesh.pipe} x data={c.mesh.data} x fsdp={c.mesh.fsdp} x "
        f"{tensor}"
    )
    say(
        f"model: {pipeline.layout.padding['model'] / 1e6:.2f}M parameters, "
        f"{sum(prepared.layers_per_stage)} blocks as {prepared.layers_per_stage} over "
        f"{schedule.num_stages} stages; padding {pipeline.layout.padding['padding_fraction']:.1%}"
    )
    say(text_chart(sim))
    say(f"simulated (F=1, B=2): bubble {sim.bubble_fraction:.1%}, {sim.peak_activations_text()}")


def _keys_seed(prepared: Prepared) -> int | None:
    """The seed of the batch's per-row keys the step adds (a model with dropout), or None."""
    return prepared.config.seed if prepared.model.keys else None


def _compile_step(
    prepared: Prepared, pipeline: jpipe.Pipeline, optimizer, lr, state, batch, interrupt: _CtrlC
):
    """The compiled train step, saying how long it took and the memory it needs per device."""
    c = prepared.config
    interrupt.doing = "compiling the train step"  # before the line a Ctrl-C may answer
    say("compiling the train step ...")
    compile_start = time.perf_counter()
    compiled = compile_train_step(
        pipeline, optimizer, lr, state, batch, _keys_seed(prepared), c.optimizer.shard_over_data
    )
    interrupt.doing = ""
    memory = compiled.memory_analysis()
    line = f"compiled the train step in {time.perf_counter() - compile_start:.1f} s"
    if memory is not None:
        line += (
            f"; per device: arguments {mib(memory.argument_size_in_bytes)}, "
            f"temporaries {mib(memory.temp_size_in_bytes)}"
        )
    say(line)
    if memory is not None and c.plan:
        say(plan_memory_line(c.plan, memory))
    return compiled


def _profile(
    prepared: Prepared, pipeline: jpipe.Pipeline, compiled, state, batch, workdir: str | None
) -> None:
    """``config.profile``: times the step's pieces and, with a `workdir` (process 0's),
    writes ``profile.json`` there for the planner."""
    c = prepared.config
    keys_seed = _keys_seed(prepared)
    rows = c.batch_size // c.num_microbatches // c.mesh.data
    microbatch = {k: v[:rows] for k, v in prepared.train_data.batch_at(0).items()}
    keyed = batch
    if keys_seed is not None:  # time the pieces the step runs, dropout included
        keyed = jax.eval_shape(lambda b: with_row_keys(b, keys_seed, 0), batch)
        microbatch = jax.device_get(with_row_keys(microbatch, keys_seed, 0))
    times = print_profile(pipeline, compiled, state, batch, microbatch, pieces_batch=keyed)
    if times is not None and workdir is not None:
        path = os.path.join(workdir, "profile.json")
        profile = stage_profile(
            pipeline,
            state.params,
            times,
            rows,
            prepared.layers_per_stage,
            opt_state=state.opt_state,
            pieces_batch=keyed,
            compiled=compiled,
        )
        save_profile(profile, path)
        say(f"profile: wrote {path} (python -m jpipe.plan --profiles {path} ...)")


def _say_held_out(eval_losses: dict[int, float]) -> None:
    """The held-out loss at the first and last evaluations of the run (or its only one)."""
    if len(eval_losses) > 1:
        first, last = min(eval_losses), max(eval_losses)
        say(
            f"held-out loss: {eval_losses[first]:.4f} at step {first} -> "
            f"{eval_losses[last]:.4f} at step {last}"
        )
    elif eval_losses:
        ((step, loss),) = eval_losses.items()
        say(f"held-out loss at step {step}: {loss:.4f}")


def _tokens_per_row(prepared: Prepared) -> int | None:
    """Tokens in one row of a batch, or None where nobody states it (the figure is then rows/s).

    The text corpus states its own: ``model.seq_len`` tokens a row. A
    source (``config.data.source``) states it with ``config.data.tokens_per_row``
    or a ``tokens_per_row`` attribute of what its function returns
    (`jpipe.train.sources`); a leaf named ``"tokens"`` is not taken as a
    statement, since its rows may hold padding or be images' patches.

    Raises:
      ConfigError: ``config.data.tokens_per_row`` contradicts the corpus's.
    """
    c = prepared.config
    stated = c.data.tokens_per_row or None
    if not c.data.source:
        if stated not in (None, c.model.seq_len):
            raise config_error(
                "data.tokens_per_row",
                stated,
                f"the text corpus has model.seq_len={c.model.seq_len} tokens a row; "
                f"accepted: 0 or {c.model.seq_len}",
            )
        return c.model.seq_len
    return stated or getattr(prepared.train_data, "tokens_per_row", None)


def _loop(run: Run, loop: LoopState, batch, start: int) -> None:
    """The training loop, from `start` to ``config.steps``; fills `loop`."""
    from tqdm import tqdm  # noqa: PLC0415 (only the loop needs it)

    c = run.prepared.config
    interrupt = run.interrupt
    # Rows, or tokens where the data states its tokens per row (`_tokens_per_row`).
    counted = c.batch_size * (run.tokens_per_row or 1)
    rate_key, rate_short = (
        ("tokens_per_s", "tok_s") if run.tokens_per_row else ("rows_per_s", "rows_s")
    )
    meta = checkpoint_meta(run.pipeline, run.prepared)
    bar = None

    def held_out(step: int) -> dict[str, float]:
        """The held-out loss and ``config.eval_fn``'s figures, as metrics."""
        data = run.prepared.eval_data
        loss = evaluate(run.pipeline, loop.state.params, data, c.eval_batches)
        loop.eval_losses[step] = loss
        figures = {"eval_loss": loss}
        text = f"step {step}: held-out loss {loss:.4f}"
        if run.eval_fn is not None:
            own = evaluate_fn(
                run.eval_fn, c.eval_fn, run.pipeline, loop.state.params, data, c.eval_batches
            )
            loop.eval_figures[step] = own
            figures.update(own)
            text += "".join(f", {k[len('eval_') :]} {v:.4g}" for k, v in own.items())
        if bar is not None and run.show_bar:
            bar.write(text)  # above the progress bar
        else:
            say(text)
        return figures

    if start == 0:
        interrupt.doing = "evaluating"
        run.metrics.write({"step": 0, **held_out(0)})
        interrupt.doing = ""
        interrupt.check(0, run.checkpoints.directory, saved=False)
    bar = tqdm(
        total=c.steps,
        initial=start,
        disable=not run.show_bar,
        dynamic_ncols=True,
        unit="step",
        file=sys.stdout,
    )
    loop.clock = time.perf_counter()
    interrupt.doing = "training"

    def finish(step: int, step_metrics: dict) -> dict:
        """Reads a dispatched step's metrics (waiting for it) and checks them."""
        values = {k: float(v) for k, v in jax.device_get(step_metrics).items()}
        now = time.perf_counter()
        seconds, loop.clock = now - loop.clock, now
        if not (math.isfinite(values["loss"]) and math.isfinite(values["grad_norm"])):
            last = run.checkpoints.latest_step()
            where = (
                f"the last good checkpoint (step {last}) in {run.checkpoints.directory} is "
                "untouched"
                if last is not None
                else "no checkpoint was written"
            )
            raise DivergedError(
                f"step {step}: the loss is {values['loss']} and the gradient norm "
                f"{values['grad_norm']}; stopping. {where}. Try a lower "
                f"optimizer.learning_rate (now {c.optimizer.learning_rate}) or "
                f"optimizer.grad_clip_norm (now {c.optimizer.grad_clip_norm})"
            )
        loop.losses[step] = values["loss"]
        loop.step_times.append(seconds)
        loop.window_seconds += seconds
        loop.window_steps += 1
        record = {"step": step, **values, "step_time": seconds, rate_key: counted / seconds}
        bar.update(1)
        if _due(step, c.log_every) or step == c.steps:
            per_step = loop.window_seconds / loop.window_steps
            bar.set_postfix(
                loss=f"{values['loss']:.4f}",
                **{rate_short: f"{counted / per_step:,.0f}"},
                step_ms=f"{per_step * 1e3:.0f}",
            )
            loop.window_seconds, loop.window_steps = 0.0, 0
        return record

    try:
        pending = None
        for index in range(start, c.steps):
            if index != start:
                batch = device_batch(run.prepared.train_data, index, run.pipeline.batch_sharding)
            # Dispatched; it runs while the last step's metrics are read.
            loop.state, step_metrics = run.compiled(loop.state, batch)
            if pending is not None:
                record = finish(*pending)
                if _due(record["step"], c.log_every):
                    run.metrics.write(record)
            pending = (index + 1, step_metrics)
            step = index + 1
            evaluating = _due(step, c.eval_every) or step == c.steps
            saving = _due(step, c.checkpoint_every) or step == c.steps
            if evaluating or saving:
                record = finish(*pending)  # waits for this step; raises before any save
                pending = None
                if evaluating:
                    record.update(held_out(step))
                if evaluating or _due(step, c.log_every) or step == c.steps:
                    run.metrics.write(record)
                if saving:
                    run.checkpoints.save(step, loop.state, meta)
                loop.clock = time.perf_counter()  # evaluation and saving are not step time
            if interrupt.requested and step < c.steps:
                if pending is not None:
                    record = finish(*pending)  # raises before any save, as above
                    pending = None
                    if _due(step, c.log_every):
                        run.metrics.write(record)
                if not saving:
                    run.checkpoints.save(step, loop.state, meta)
                raise Interrupted(step, run.checkpoints.directory)
    finally:
        interrupt.doing = ""
        bar.close()


class _CtrlC(contextlib.AbstractContextManager):
    """Ctrl-C (SIGINT) as a flag that `train` reads at safe points, for the whole call.

    The first Ctrl-C only sets `requested` and says what happens next; the
    trainer calls `check` where stopping is safe (never inside JAX, XLA or
    orbax code), and `check` raises `Interrupted`. A second Ctrl-C ends the
    process at once with exit status 130 (`os._exit`: no exception, so
    nothing half-raised inside XLA, and no interpreter teardown while its
    threads run); the newest complete checkpoint stays, and an unfinished
    one is removed when the next run starts.

    Python runs a signal's handler in the main thread between bytecodes,
    so not while XLA compiles (one long C++ call) or orbax waits on its
    writes. The answer must not wait for that: the signal's byte also goes
    to a pipe (`signal.set_wakeup_fd`, written by the C-level handler as the
    signal lands) that a small thread reads, which prints the notice and,
    on the second Ctrl-C, ends the process. (Where the process already has a
    wakeup fd, an asyncio loop's say, only the handler answers.)

    Only in the main thread of a one-process run where Python's own handler
    is in place: in a run of several processes all would have to stop at
    the same step (orbax saves together), which one process's signal cannot
    promise, so there Ctrl-C keeps its usual meaning, as it does for a
    caller that installed a handler of its own.

    Attributes:
      requested: a Ctrl-C came.
      doing: what the run is doing, for the message a Ctrl-C prints
        (``"training"``: the loop, which saves the step in flight first).
    """

    def __init__(self):
        self.requested = False
        self.doing = ""
        self._installed = False
        self._signals = 0
        self._lock = threading.Lock()
        self._pipe: tuple[int, int] | None = None
        self._watcher: threading.Thread | None = None

    def __enter__(self) -> _CtrlC:
        self._installed = (
            threading.current_thread() is threading.main_thread()
            and num_processes() == 1
            and signal.getsignal(signal.SIGINT) is signal.default_int_handler
        )
        if not self._installed:
            return self
        signal.signal(signal.SIGINT, self._on_signal)
        read, write = os.pipe()
        os.set_blocking(write, False)  # the C-level handler must never block
        previous = signal.set_wakeup_fd(write, warn_on_full_buffer=False)
        if previous != -1:
            signal.set_wakeup_fd(previous)  # someone else's: put it back, answer from the handler
            os.close(read)
            os.close(write)
            return self
        self._pipe = (read, write)
        self._watcher = threading.Thread(target=self._watch, name="jpipe-ctrl-c", daemon=True)
        self._watcher.start()
        return self

    def __exit__(self, *exc) -> None:
        if not self._installed:
            return
        signal.signal(signal.SIGINT, signal.default_int_handler)
        self._installed = False
        if self._pipe is not None:
            signal.set_wakeup_fd(-1)
            os.close(self._pipe[1])  # the watcher reads the end of the pipe and stops
            self._watcher.join()
            self._pipe = self._watcher = None

    def check(self, step: int, directory: str, saved: bool, finished: bool = False) -> None:
        """Raises `Interrupted` (`step`, `directory`, `saved`, `finished`) if a Ctrl-C came."""
        if self.requested:
            raise Interrupted(step, directory, saved, finished)

    def _on_signal(self, signum, frame) -> None:
        """Python's handler: runs in the main thread between bytecodes, maybe late."""
        if self._pipe is None:  # no watcher: answer here
            self._answer()
        self.requested = True

    def _watch(self) -> None:
        """The watcher thread: answers each SIGINT as it lands."""
        read = self._pipe[0]
        try:
            while True:
                data = os.read(read, 64)
                if not data:  # the write end closed: `train` is over
                    return
                for _ in range(data.count(signal.SIGINT)):
                    self._answer()
        finally:
            os.close(read)

    def _answer(self) -> None:
        """Counts a Ctrl-C: the first says what happens next, the second ends the process."""
        with self._lock:
            self._signals += 1
            first = self._signals == 1
        if not first:
            _notice("\nCtrl-C again: stopping now, without saving\n")
            os._exit(130)
        self.requested = True
        if self.doing == "training":
            text = "saving a checkpoint after this step"
        elif self.doing:
            text = f"stopping once {self.doing} ends"
        else:
            text = "stopping at the next safe point"
        _notice(f"\nCtrl-C: {text} (Ctrl-C again stops at once, unsaved)\n")


def _notice(text: str) -> None:
    """Writes `text` to standard output from a signal handler.

    Straight to the file descriptor: `print` there can meet the main
    thread inside a write to the same stream and raise "reentrant call".
    """
    for stream in (sys.stdout, sys.__stdout__):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001 (the main thread may be writing to it)
            pass
        try:
            os.write(stream.fileno(), text.encode())
            return
        except Exception:  # noqa: BLE001 (no file descriptor: pytest's capture, a notebook)
            continue
