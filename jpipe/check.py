"""Check a schedule against the unpipelined model on CPU fake devices.

Usage::

    python -m jpipe.check SPEC --ranks R --microbatches M [--chunks V] [--data D] [--json]
    python -m jpipe.check SPEC -r R -m M --lowering mpmd
    python -m jpipe.check SPEC -r R -m M --tensor 2 [--fsdp 2] --model my_model.py:build
    python -m jpipe.check SPEC -r R -m M --model my_model.py:build [--config my_config.py]

Under ``python -m jpipe.launch -n N --cpu_devices K`` the mesh spans the N
processes (N x K devices) and each process checks the result.

SPEC is a registered schedule name, a PyTorch ``.csv`` file (its ranks and
microbatches come from the file), or ``path/to/file.py:function``, with the
schedule function's options after a last colon (``my.py:fn:warmup=6``) or one
per ``--option warmup=6``. The tool
fakes as many CPU devices as the mesh needs, runs the schedule on jpipe's
small built-in model (embedding first, head and loss last), compares the loss
and every gradient with the model without a pipeline, prints the largest
absolute and relative error and PASS or FAIL, and exits 0 only on PASS.
``--json`` prints one JSON object instead (see `jpipe.testing.CheckResult`).

``--model path/to/file.py:function`` runs your own stages instead, built
by the same function ``train.py --config.model=`` names:
``build(args: jpipe.models.BuildArgs) -> jpipe.models.StagedModel``, given
the schedule's number of stages and ``config.model``'s fields from
``--config FILE`` (a ``train.py`` config; by default the file's own
``get_config()``, as in ``examples/``), its weights from ``init(0)`` and its
batch from that config's ``config.data`` (the first training batch). The
checker's own form still works: a function of the number of stages
returning a `jpipe.testing.CheckModel` (your stage functions, their whole
parameters, their `PartitionSpec`s, a batch maker, and the unsplit reference
stages or None for your stages under `jax.shard_map`); see
`jpipe.testing.load_model` for how the two are told apart. ``--model
tensor:BLOCK`` runs a built-in one whose stages
write their own collectives over ``tensor`` (`jpipe.testing.TENSOR_BLOCKS`).
``--tensor`` and ``--fsdp`` add those mesh axes. ``--lowering mpmd`` checks
the schedule under the per-rank lowering (one program per piece on each
rank's devices, `jpipe.Pipeline`'s ``lowering="mpmd"``) instead of the
default single SPMD program, so that you check the lowering you will run;
the report names it.
"""

from __future__ import annotations

import argparse
import json
import sys

from jpipe.lower.interface import lowering_kind
from jpipe.runtime.console import run_main
from jpipe.schedule.registry import add_option_argument, get_schedule, parse_options
from jpipe.schedule.validate import ScheduleError


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m jpipe.check", description=__doc__.split("\n")[0]
    )
    parser.add_argument("spec", help="a schedule name, a .csv file, or path/to/file.py:function")
    parser.add_argument(
        "-r",
        "--ranks",
        "--num_ranks",
        dest="ranks",
        type=int,
        default=None,
        help="pipeline ranks (R)",
    )
    parser.add_argument(
        "-m",
        "--microbatches",
        "--num_microbatches",
        dest="microbatches",
        type=int,
        default=None,
        help="microbatches (M)",
    )
    parser.add_argument(
        "--chunks",
        "--num_chunks",
        dest="chunks",
        type=int,
        default=None,
        help="stages per rank (V); default: the schedule's own",
    )
    add_option_argument(parser)
    parser.add_argument("--data", type=int, default=1, help="size of the data axis (D)")
    parser.add_argument("--fsdp", type=int, default=1, help="size of the fsdp axis")
    parser.add_argument("--tensor", type=int, default=1, help="size of the tensor axis")
    parser.add_argument(
        "--model",
        default=None,
        help="path/to/file.py:build, the train.py model builder (build(BuildArgs) -> "
        "StagedModel; or build(num_stages) -> jpipe.testing.CheckModel), or tensor:BLOCK "
        "(mlp, attention, two_blocks, sequence); default: the built-in small model",
    )
    parser.add_argument(
        "--config",
        default=None,
        help="with --model FILE.py:build (the trainer's builder): the train.py config whose "
        "config.model builds it and whose config.data gives the batch; default: the file's "
        "own get_config()",
    )
    parser.add_argument(
        "--layout",
        choices=("auto", "unit", "packed"),
        default="auto",
        help="tick layout: one piece per rank per tick (unit), up to one F, I and W "
        "(packed), or packed where no slower (auto, the default)",
    )
    parser.add_argument(
        "--lowering",
        choices=("spmd", "mpmd"),
        default="spmd",
        help="spmd: one program for the whole mesh; mpmd: one program per piece on each "
        "rank's devices (see jpipe.Pipeline)",
    )
    parser.add_argument("--rtol", type=float, default=1e-5, help="largest accepted relative error")
    parser.add_argument(
        "--compute-dtype",
        default="float32",
        choices=("float32", "bfloat16", "float16"),
        help="compute in this dtype from float32 parameters, against the same policy "
        "unpipelined on the same microbatches (see jpipe.testing.check_schedule)",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)
    try:
        schedule = get_schedule(
            args.spec, args.ranks, args.microbatches, args.chunks, **parse_options(args.option)
        )
        if args.config is not None and args.model is None:
            raise ValueError("--config is a model builder's config: give --model FILE.py:build")
        for flag in ("data", "fsdp", "tensor"):
            if getattr(args, flag) < 1:
                raise ValueError(f"--{flag} must be at least 1, got {getattr(args, flag)}")
        import jax

        try:  # the check runs on the CPU; do not start (or grab) an accelerator
            jax.config.update("jax_platforms", "cpu")
        except RuntimeError:
            pass
        from jpipe.runtime.distributed import initialize_distributed
        from jpipe.testing import check_schedule, ensure_cpu_devices

        # joins the other processes when jpipe.launch (or a cluster) started several
        initialize_distributed()

        ensure_cpu_devices(schedule.num_ranks * args.data * args.fsdp * args.tensor)
        result = check_schedule(
            schedule,
            data=args.data,
            fsdp=args.fsdp,
            tensor=args.tensor,
            model=args.model,
            rtol=args.rtol,
            tick_layout=args.layout,
            compute_dtype=args.compute_dtype,
            config=args.config,
            lowering=args.lowering,
        )
    except (ScheduleError, ValueError, RuntimeError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(result.summary()))
    else:
        axes = "".join(
            f" x {n} {axis}"
            for axis, n in (("fsdp", result.fsdp), ("tensor", result.tensor))
            if n > 1
        )
        model = "" if result.model == "small_model" else f", {result.model}"
        print(
            f"{result.schedule}: {result.ranks} ranks x {result.data} data{axes}, "
            f"{result.stages} stages, {result.microbatches} microbatches, {result.ticks} ticks "
            f"({result.tick_layout}), {result.lowering} lowering{model}"
        )
        print(f"loss {result.loss:.7g} (reference {result.reference_loss:.7g})")
        print(f"max abs error {result.max_abs_err:.3g}, max rel error {result.max_rel_err:.3g}")
        piece = "" if lowering_kind(result.lowering).one_program else " (the largest piece)"
        print(
            f"compile {result.compile_seconds:.2f}s, per device{piece}: temp "
            f"{result.temp_bytes / 2**20:.2f} MiB, "
            f"arguments {result.argument_bytes / 2**20:.2f} MiB"
        )
        print("PASS" if result.passed else f"FAIL (tolerance {result.rtol:g})")
    return 0 if result.passed else 1


if __name__ == "__main__":
    sys.exit(run_main(main))
