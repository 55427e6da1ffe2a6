"""Step 4 of a run: build, compile and loop; `train` is what ``train.py`` calls.

The loop dispatches step N before it reads step N-1's metrics, so the host
never waits on the device except to evaluate, to checkpoint (only after
checking the loss) and at the end. Batches come from
`jpipe.train.data.Batches.batch_at(step, ...)`, a pure function of the step,
so a resumed run sees exactly the batches an uninterrupted one would and gives
the same losses, bit for bit. A NaN or infinite loss (or gradient norm) stops
the run with `DivergedError` before any later checkpoint.
"""

from __future__ import annotations

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
import numpy as np
from jax.experimental import multihost_utils

import jpipe
from jpipe._chart import text_chart
from jpipe.planner import save_profile
from jpipe.train import optimizer as optimizer_lib
from jpipe.train.checkpoint import Checkpoints, check_resumable, checkpoint_meta
from jpipe.train.config import ConfigError, TrainConfig
from jpipe.train.data import device_batch
from jpipe.train.metrics import Metrics, mib, say
from jpipe.train.prepare import Prepared, prepare
from jpipe.train.profile import plan_memory_line, print_profile, stage_profile
from jpipe.train.step import (
    ROW_KEYS,
    TrainState,
    compile_train_step,
    state_shardings,
    with_row_keys,
)


class DivergedError(FloatingPointError):
    """The loss or the gradient norm became NaN or infinite."""


class Interrupted(KeyboardInterrupt):
    """Ctrl-C (SIGINT) stopped `train` between steps, after saving a checkpoint.

    Attributes:
      step: the step reached, whose checkpoint is saved: training again in the
        same directory resumes from it.
      directory: the checkpoint directory.
    """

    def __init__(self, step: int, directory: str):
        super().__init__(f"interrupted at step {step}; its checkpoint is in {directory}")
        self.step = step
        self.directory = directory


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
      tokens_per_second: training tokens per second at that median.
    """

    losses: dict[int, float]
    eval_losses: dict[int, float]
    start_step: int
    final_step: int
    wall_seconds: float
    step_seconds: float | None
    tokens_per_second: float | None


class Run(NamedTuple):
    """What the loop runs: built once, read-only.

    Attributes:
      prepared: the checked config, schedule, mesh and data.
      pipeline: the model, schedule and mesh.
      compiled: the compiled train step ``(state, batch) -> (state, metrics)``.
      checkpoints: the run directory's checkpoints.
      metrics: where records go.
      show_bar: whether to draw the progress bar.
    """

    prepared: Prepared
    pipeline: jpipe.Pipeline
    compiled: object
    checkpoints: Checkpoints
    metrics: Metrics
    show_bar: bool


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


def make_workdir(workdir: str) -> str:
    """Creates the work directory on process 0; every process returns once it exists.

    In a multi-process run the others wait (a collective) for process 0's
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
    if jax.process_count() > 1:
        code = np.frombuffer(problem.encode()[:200].ljust(200), np.uint8)
        code = multihost_utils.broadcast_one_to_all(code)  # also the barrier
        problem = bytes(np.asarray(code)).decode(errors="replace").strip()
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
    prepared = prepare(config)
    lead = jax.process_index() == 0
    workdir = make_workdir(workdir)
    checkpoints = Checkpoints(os.path.join(workdir, "checkpoints"))
    try:
        return _run(prepared, workdir, checkpoints, lead, progress, wall_start)
    finally:
        checkpoints.close()


def _run(
    prepared: Prepared,
    workdir: str,
    checkpoints: Checkpoints,
    lead: bool,
    progress: bool,
    wall_start: float,
) -> TrainResult:
    c, schedule, mesh = prepared.config, prepared.schedule, prepared.mesh
    removed = checkpoints.remove_incomplete()
    start = checkpoints.latest_step()
    if start is not None:
        check_resumable(checkpoints, start, prepared)  # before anything is compiled
        if start >= c.steps:
            say(
                f"nothing to do: {checkpoints.directory} is at step {start}, config.steps={c.steps}"
            )
            return TrainResult({}, {}, start, start, time.perf_counter() - wall_start, None, None)

    model = prepared.model  # the stages config.model.name builds (jpipe.models.build_model)
    if model.keys not in (None, ROW_KEYS):
        raise ConfigError(
            f"config.model.name={c.model_name!r}: its stages read per-row keys from the batch "
            f"leaf {model.keys!r}, but the trainer adds them as {ROW_KEYS!r}; build the model "
            f"with keys={ROW_KEYS!r}"
        )
    pipeline = jpipe.Pipeline(
        model.stages, schedule, mesh, tick_layout=c.tick_layout, lowering=c.lowering
    )

    # Each rank's devices make only that rank's parameters, each device its
    # own block of them (`Pipeline.init`): no device or host holds the model.
    key = jax.random.key(c.seed)
    specs = model.specs(jax.eval_shape(model.init, key)) if model.specs is not None else None
    params = pipeline.init(model.init, key, specs)
    if pipeline.rank_meshes is not None:  # one dict per rank on its own mesh: one AdamW each
        optimizer = optimizer_lib.per_rank_optimizers(c.optimizer, c.steps, pipeline)
    else:
        optimizer = optimizer_lib.make_optimizer(
            c.optimizer, c.steps, optimizer_lib.packed_decay_rows(pipeline)
        )
    lr = optimizer_lib.learning_rate_schedule(c.optimizer, c.steps)
    state = TrainState(jnp.zeros((), jnp.int32), params, optimizer.init(params))
    zero1 = c.optimizer.shard_over_data
    state = jax.device_put(state, state_shardings(state, pipeline, zero1))

    if start is not None:
        buckets = checkpoints.metadata(start).get("buckets")
        if buckets != checkpoint_meta(pipeline, prepared)["buckets"]:
            raise ConfigError(
                f"the checkpoint of step {start} in {checkpoints.directory} packs the parameters "
                "into other buckets (written by another version of jpipe?); give a new --workdir"
            )
        state = checkpoints.restore(start, state)
    start = int(start or 0)

    # -- what a person sees before the first step --
    sim = jpipe.simulate(schedule)
    processes = f" in {jax.process_count()} processes" if jax.process_count() > 1 else ""
    meshes = mesh if isinstance(mesh, list) else [mesh]
    tensor = (
        f"tensor per rank {c.mesh.tensor_per_rank} (a mesh per rank)"
        if c.mesh.rank_tensors
        else f"tensor={c.mesh.tensor}"
    )
    say(
        f"devices: {jpipe.describe_devices([d for m in meshes for d in m.devices.flat])}"
        f"{processes}; mesh pipe={c.mesh.pipe} x data={c.mesh.data} x fsdp={c.mesh.fsdp} x "
        f"{tensor}"
    )
    say(
        f"model: {pipeline.layout.padding['used'] / 1e6:.2f}M parameters, "
        f"{sum(prepared.layers_per_stage)} blocks as {prepared.layers_per_stage} over "
        f"{schedule.num_stages} stages; padding {pipeline.layout.padding['padding_fraction']:.1%}"
    )
    say(text_chart(sim))
    say(
        f"simulated (F=1, B=2): bubble {sim.bubble_fraction:.1%}, peak live activations per "
        f"rank {list(sim.peak_activations)} microbatches"
    )

    batch = device_batch(prepared.train_data, start, pipeline.batch_sharding)
    compile_start = time.perf_counter()
    # A model with dropout: the step adds the batch's per-row keys from the seed.
    keys_seed = c.seed if model.keys else None
    compiled = compile_train_step(pipeline, optimizer, lr, state, batch, keys_seed, zero1)
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
    if c.profile:
        rows = c.batch_size // c.num_microbatches // c.mesh.data
        microbatch = {k: v[:rows] for k, v in prepared.train_data.batch_at(0).items()}
        keyed = batch
        if keys_seed is not None:  # time the pieces the step runs, dropout included
            keyed = jax.eval_shape(lambda b: with_row_keys(b, keys_seed, 0), batch)
            microbatch = jax.device_get(with_row_keys(microbatch, keys_seed, 0))
        times = print_profile(pipeline, compiled, state, batch, microbatch, pieces_batch=keyed)
        if times is not None and lead:
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

    if removed:
        say(f"removed unfinished checkpoint(s) {removed}")
    if start:
        say(f"resuming from the checkpoint of step {start} in {checkpoints.directory}")
    # Records past the checkpoint are rewritten by this run; a fresh start
    # (no checkpoint) rewrites them all, step 0 included.
    metrics = Metrics(workdir, start if start else -1, lead)
    if lead and metrics.tensorboard_name:
        say(f"TensorBoard ({metrics.tensorboard_name}): {os.path.join(workdir, 'tensorboard')}")

    run = Run(prepared, pipeline, compiled, checkpoints, metrics, lead and progress)
    loop = LoopState(state)
    try:
        _loop(run, loop, batch, start)
    finally:
        metrics.close()  # its TensorBoard writer's threads end with the run, however it ends
    step_seconds = statistics.median(loop.step_times) if loop.step_times else None
    tokens = c.batch_size * _tokens_per_row(batch)
    tps = tokens / step_seconds if step_seconds else None
    wall = time.perf_counter() - wall_start
    eval_losses = loop.eval_losses
    if len(eval_losses) > 1:
        first, last = min(eval_losses), max(eval_losses)
        say(
            f"held-out loss: {eval_losses[first]:.4f} at step {first} -> "
            f"{eval_losses[last]:.4f} at step {last}"
        )
    elif eval_losses:
        ((step, loss),) = eval_losses.items()
        say(f"held-out loss at step {step}: {loss:.4f}")
    if step_seconds:
        say(
            f"median step {step_seconds * 1e3:.1f} ms, {tps:,.0f} tokens/s; "
            f"wall time {wall:.1f} s; metrics in {metrics.path}"
        )
    final = max(loop.losses) if loop.losses else start
    return TrainResult(loop.losses, eval_losses, start, final, wall, step_seconds, tps)


def _tokens_per_row(batch: dict) -> int:
    """Tokens in each row of a batch: the length of its ``"tokens"``, else 1 (a row is an item)."""
    tokens = batch.get("tokens")
    return int(tokens.shape[1]) if tokens is not None and tokens.ndim >= 2 else 1


def _loop(run: Run, loop: LoopState, batch, start: int) -> None:
    """The training loop, from `start` to ``config.steps``; fills `loop`."""
    from tqdm import tqdm  # noqa: PLC0415 (only the loop needs it)

    c = run.prepared.config
    tokens = c.batch_size * _tokens_per_row(batch)
    meta = checkpoint_meta(run.pipeline, run.prepared)
    bar = None

    def held_out(step: int) -> float:
        loss = evaluate(run.pipeline, loop.state.params, run.prepared.eval_data, c.eval_batches)
        loop.eval_losses[step] = loss
        text = f"step {step}: held-out loss {loss:.4f}"
        if bar is not None and run.show_bar:
            bar.write(text)  # above the progress bar
        else:
            say(text)
        return loss

    if start == 0:
        run.metrics.write({"step": 0, "eval_loss": held_out(0)})
    bar = tqdm(
        total=c.steps,
        initial=start,
        disable=not run.show_bar,
        dynamic_ncols=True,
        unit="step",
        file=sys.stdout,
    )
    loop.clock = time.perf_counter()
    interrupt = _InterruptRequest()

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
        record = {"step": step, **values, "step_time": seconds, "tokens_per_s": tokens / seconds}
        bar.update(1)
        if _due(step, c.log_every) or step == c.steps:
            per_step = loop.window_seconds / loop.window_steps
            bar.set_postfix(
                loss=f"{values['loss']:.4f}",
                tok_s=f"{tokens / per_step:,.0f}",
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
                    record["eval_loss"] = held_out(step)
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
        interrupt.close()
        bar.close()


class _InterruptRequest:
    """The first Ctrl-C (SIGINT) as a request that the loop serves between steps.

    The step in flight finishes and is checkpointed, then `train` raises
    `Interrupted`; a second Ctrl-C interrupts at once, saving nothing. Only
    in the main thread of a single-process run, where Python's own handler
    is in place: in a run of several processes all would have to stop at the
    same step (orbax saves together), which one process's signal cannot
    promise, so there Ctrl-C keeps its usual meaning.
    """

    def __init__(self):
        self.requested = False
        self._installed = (
            threading.current_thread() is threading.main_thread()
            and jax.process_count() == 1
            and signal.getsignal(signal.SIGINT) is signal.default_int_handler
        )
        if self._installed:
            signal.signal(signal.SIGINT, self._on_signal)

    def _on_signal(self, signum, frame) -> None:
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True
        say("\nCtrl-C: saving a checkpoint after this step (Ctrl-C again stops at once, unsaved)")

    def close(self) -> None:
        if self._installed:
            signal.signal(signal.SIGINT, signal.default_int_handler)
            self._installed = False
