"""Trains a GPT with a pipeline schedule, from a config file and flags.

  python train.py                                   # configs/default.py, runs/default
  python train.py --config.model=llama              # a registered model (or file.py:build)
  python train.py --config=configs/FILE.py --config.schedule=zb_h1 \\
      --config.num_microbatches=16 --config.mesh.pipe=4 --config.mesh.data=2 --workdir=DIR

Restarting with the same --workdir resumes from its newest checkpoint.
--config.compile_only=True trains nothing and touches no --workdir: it compiles
the config's train step from shapes and prints each device's bytes against
--config.compile_only_device_memory (jpipe/train/compile_only.py). On a
CPU-only machine as many CPU devices are faked as the mesh needs
(--cpu_devices or --config.cpu_devices overrides); never when a GPU or TPU is present.
See jpipe/train/ for what happens and configs/*.py for every field.

Several processes (hosts): give each --coordinator_address, --num_processes
and --process_id (or the JAX_* environment variables, or run under SLURM,
Open MPI or Kubernetes, which JAX detects), or on one machine:

  python -m jpipe.launch -n 2 --cpu_devices 2 -- train.py --workdir=DIR

See docs/multihost.md.
"""

import os
import shlex
import shutil
import sys

from absl import app, flags, logging
from ml_collections import config_flags

import jpipe
from jpipe import train as trainer
from jpipe.train import config as trainer_config

_HERE = os.path.dirname(os.path.abspath(__file__))

_DEFAULT_CONFIG = os.path.join(_HERE, "configs", "default.py")
if __name__ == "__main__":  # a --config.FIELD typo: one line (ml_collections raises at define)
    sys.argv[:] = trainer_config.expand_shorthands(sys.argv)  # --config.model=file.py:build
    _TYPO = trainer_config.unknown_override(sys.argv, _DEFAULT_CONFIG)
    if _TYPO:
        sys.exit(f"error: {_TYPO}")
_CONFIG = config_flags.DEFINE_config_file("config", _DEFAULT_CONFIG, "Training config file.")
_WORKDIR = flags.DEFINE_string(
    "workdir", "runs/default", "Checkpoints, metrics.jsonl and TensorBoard logs go here."
)
_CPU_DEVICES = flags.DEFINE_integer(
    "cpu_devices",
    None,
    "CPU devices to fake per process on a CPU-only host (sets config.cpu_devices).",
)
# Several processes: JAX's own names (jax.distributed.initialize); see docs/multihost.md.
_COORDINATOR = flags.DEFINE_string(
    "coordinator_address", None, "host:port of process 0, for a multi-process run."
)
_NUM_PROCESSES = flags.DEFINE_integer("num_processes", None, "Processes in a multi-process run.")
_PROCESS_ID = flags.DEFINE_integer("process_id", None, "This process's index, 0 to N - 1.")
_LOCAL_DEVICE_IDS = flags.DEFINE_string(
    "local_device_ids", None, "Comma-separated accelerator ids this process uses."
)


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    if not flags.FLAGS["verbosity"].present:
        logging.set_verbosity(logging.WARNING)  # orbax logs each save at INFO; -v 0 shows that
    try:  # joins the other processes, if any, before any JAX work
        jpipe.initialize_distributed(
            _COORDINATOR.value, _NUM_PROCESSES.value, _PROCESS_ID.value, _LOCAL_DEVICE_IDS.value
        )
    except ValueError as e:
        sys.exit(f"error: {e}")
    config = _CONFIG.value
    if _CPU_DEVICES.value is not None:
        config.cpu_devices = _CPU_DEVICES.value
    trainer.use_cpu_devices(config)  # before JAX starts its backends
    if config.get("compile_only", False):  # no training: the step compiled from shapes
        from jpipe.train import compile_only

        try:
            sys.exit(compile_only.run(config))
        except trainer.ConfigError as e:
            sys.exit(f"error: {e}")
    try:
        trainer.train(config, _WORKDIR.value)
    except (trainer.ConfigError, trainer.DivergedError) as e:
        jpipe.exit_distributed(f"error: {e}")  # in a multi-process run: at once, naming the process
    except trainer.Interrupted as e:  # Ctrl-C, served at a safe point (jpipe.train.loop)
        if e.finished:
            print(
                f"interrupted after the last step ({e.step}): the run is complete, its "
                f"checkpoint saved in {e.directory}"
            )
        elif e.saved:
            print(f"interrupted at step {e.step}, checkpoint saved; resume with: {_command()}")
        elif e.step:
            print(
                f"interrupted before training on from step {e.step} (its checkpoint is in "
                f"{e.directory}); resume with: {_command()}"
            )
        else:
            print(f"interrupted before the first step; nothing was saved; start with: {_command()}")
        sys.exit(130)
    except KeyboardInterrupt:  # Ctrl-C's usual meaning: a run of several processes
        print(
            "interrupted before a checkpoint could be saved; the same command resumes from the "
            f"newest one in {_WORKDIR.value}, if any: {_command()}"
        )
        sys.exit(130)


def _command() -> str:
    """This process's command line, to run again."""
    python = sys.executable
    if shutil.which("python") and os.path.realpath(shutil.which("python")) == os.path.realpath(
        python
    ):
        python = "python"
    return shlex.join([python, *sys.argv])


if __name__ == "__main__":
    try:
        app.run(main)
    except KeyboardInterrupt:  # before the run started (importing, parsing)
        print("interrupted before the run started; nothing was saved")
        sys.exit(130)
