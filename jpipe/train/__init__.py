"""The trainer: a model (the GPT unless config.model.name says otherwise), a schedule, a mesh.

One module per concern, in the order a run uses them: `config` (the
config's dataclasses and their checks), `prepare` (step 1), `optimizer`
(step 2), `step` (step 3, the one jit), `data` (the corpus and batches on
devices), `checkpoint`, `metrics`, `profile`, and `loop` (step 4); `export`
takes a checkpoint's parameters out as the model's own pytrees
(`load_params`, `save_params`) and brings them in (``config.init_from``),
docs/checkpoints.md.

`train(config, workdir)` is what ``train.py`` calls. It goes in one direction:

1. **Check.** The `ml_collections.ConfigDict` becomes a `TrainConfig`, typed
   frozen dataclasses that check every field. Then everything that can be
   refused without compiling is: the mesh is checked against the devices,
   the schedule is built and validated, the layers are split over its
   stages, the batch is checked against the microbatches and the data axis,
   and the corpus against the batch. A `ConfigError` names the field, the value, and what would be
   accepted. Nothing has been compiled yet.
2. **Build.** The model is cut into ``schedule.num_stages`` stages, the
   `jpipe.Pipeline` packs each rank's parameters, and the
   optimizer is built on the packed dict: the optax optimizer
   ``config.optimizer.name`` names (AdamW by default) with the learning-rate
   schedule ``config.optimizer.lr_schedule`` names (linear warm-up and
   cosine decay by default), weight decay masked off norms and biases (per bucket row:
   a bucket holds arrays of one size, whatever their shape), and
   `optax.clip_by_global_norm` over all the packed gradients. The packed
   arrays are sharded over ``pipe``, so that norm is taken over every stage's
   gradients together, not per stage; a bucket's padding rows (ranks without
   such an array) have zero gradients, add nothing to the norm, and stay zero
   under AdamW. The optimizer state is laid out like the parameters, so each
   device holds only its own stages' state.
3. **Compile.** `train_step` is jitted once, in `compile_train_step`, with
   explicit shardings and the state donated. Evaluation uses the pipeline's
   own forward-only loss (`Pipeline.loss`).
4. **Run.** The loop dispatches step N before it reads step N-1's metrics, so
   the host never waits on the device except to evaluate, to checkpoint
   (only after checking the loss) and at the end. Batches come from
   `jpipe.train.data.Batches.batch_at(step, ...)`, a pure function of the step, so
   a resumed run sees exactly the batches an uninterrupted one would and
   gives the same losses, bit for bit. A NaN or infinite loss (or gradient
   norm) stops the run with `DivergedError` before any later checkpoint.
   Ctrl-C (SIGINT) lets the step in flight finish, saves its checkpoint and
   raises `Interrupted` (``train.py`` prints the command that resumes); at
   any other moment (compiling, say) it stops once that part ends; a second
   Ctrl-C stops at once; ``train.py``'s exit status is 130.

Reported: before the first step the schedule's chart, its simulated bubble
and peak live activations, and the compiled step's memory; during training a
progress bar (loss, tokens/s, or rows/s where the data does not state its
tokens per row, step time); every ``eval_every`` steps the
held-out loss. ``DIR/metrics.jsonl`` gets one JSON object per logged step:
``step`` (optimizer steps done), ``loss`` (the training loss of that step's
batch), ``grad_norm``, ``lr``, ``step_time``, ``tokens_per_s`` (or
``rows_per_s``), and ``eval_loss`` on evaluated steps (with ``eval_NAME``
for each figure of ``config.eval_fn``); a fresh run starts with a ``step: 0`` line
that holds only ``eval_loss``, the held-out loss before training. TensorBoard
event files in ``DIR/tensorboard/`` get the same (tensorboardX, a dependency).

Several processes: each process builds only the rows of the global batch
that its devices hold (``jax.make_array_from_process_local_data``), every
process takes part in checkpoints (orbax coordinates them), and only process
0 prints, writes ``metrics.jsonl`` and TensorBoard.
"""

from jpipe.train.config import (
    ConfigError,
    DataConfig,
    MeshConfig,
    OptimizerConfig,
    TrainConfig,
    config_from_file,
    use_cpu_devices,
)
from jpipe.train.export import load_params, save_params
from jpipe.train.loop import DivergedError, Interrupted, TrainResult, train
from jpipe.train.prepare import Prepared, prepare

__all__ = [
    "ConfigError",
    "DataConfig",
    "DivergedError",
    "Interrupted",
    "MeshConfig",
    "OptimizerConfig",
    "Prepared",
    "TrainConfig",
    "TrainResult",
    "config_from_file",
    "load_params",
    "prepare",
    "save_params",
    "train",
    "use_cpu_devices",
]
