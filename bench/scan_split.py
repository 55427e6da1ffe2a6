"""The I/W split of scanned layers against unrolled ones: ``python -m bench.scan_split``.

For the GPT (`jpipe.models.gpt`) with its blocks unrolled and with
``scan_layers=True`` (one ``nn.scan`` per stage), same sizes and same
weights, it prints per stage: the I-to-W carry (elements, the sum of
`StageKernels.carry_avals` sizes), the number of matmuls (``dot_general``)
and their FLOPs in the I and W pieces, counted in the jaxprs with a scan's
body once per iteration (XLA's ``cost_analysis()`` counts a while loop's
body once, so it cannot compare the two), then the ZB-H1 bubble simulated
with those FLOPs as per-stage F/I/W costs, and the largest relative error of
loss and gradients against the unpipelined model under 1F1B and ZB-H1.
Then the carry and FLOPs at the benchmark's GPT shape (traced only). Prints
a markdown table; takes about 3 minutes on 2 busy shared cores.
"""

from __future__ import annotations

import dataclasses
import os
import sys

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import numpy as np  # noqa: E402

import jpipe  # noqa: E402
from jpipe import Pipeline, StageKernels, make_mesh, testing  # noqa: E402
from jpipe.models import gpt  # noqa: E402

CONFIG = gpt.GPTConfig(vocab_size=32, seq_len=8, num_layers=6, num_heads=2, d_model=16, d_ff=32)
SPLIT = "2,2,2"
MICROBATCH = 2  # sequences


def _dots(jaxpr) -> tuple[int, int]:
    """``(matmuls, FLOPs)`` of a jaxpr, a scan's body counted once per iteration."""
    count, flops = 0, 0
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "dot_general":
            (contract, _), _ = eqn.params["dimension_numbers"]
            lhs = eqn.invars[0].aval.shape
            count += 1
            flops += (
                2
                * int(np.prod(eqn.outvars[0].aval.shape))
                * int(np.prod([lhs[d] for d in contract]))
            )
        times = eqn.params["length"] if eqn.primitive.name == "scan" else 1
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            c, f = _dots(sub)
            count, flops = count + times * c, flops + times * f
    return count, flops


# The benchmark's GPT shape (bench/workloads.py), traced only: carry and FLOPs.
LARGE = gpt.GPTConfig(vocab_size=256, seq_len=32, num_layers=8, num_heads=4, d_model=256, d_ff=1024)
LARGE_SPLIT, LARGE_MICROBATCH = "2,2,2,2", 4


def stage_figures(
    scan_layers: bool, config=CONFIG, split=SPLIT, microbatch=MICROBATCH
) -> list[dict]:
    """Carry, and matmuls and FLOPs of F, I and W, for each stage."""
    model = gpt.make_stages(dataclasses.replace(config, scan_layers=scan_layers), split)
    batch = gpt.example_batch(config, microbatch)
    inputs = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), batch)
    x, rows = None, []
    for fn, params in zip(model.stages, model.init(0)):
        k = StageKernels.trace(fn, params, x, inputs)
        g = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in jax.tree.leaves(k.y)]
        carry = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in k.carry_avals]
        pieces = {
            "F": jax.make_jaxpr(k.forward)(params, k.x, inputs),
            "I": jax.make_jaxpr(k.input_grad)(params, inputs, k.res_avals, g),
            "W": jax.make_jaxpr(k.weight_grad)(params, inputs, k.res_avals, carry),
        }
        row = {"carry": sum(int(np.prod(a.shape)) for a in k.carry_avals)}
        for name, closed in pieces.items():
            row[name + " dots"], row[name + " flops"] = _dots(closed.jaxpr)
        rows.append(row)
        x = k.y
    return rows


def exactness(scan_layers: bool, name: str, ranks: int = 3) -> float:
    """The largest relative error of loss and gradients through the pipeline."""
    config = dataclasses.replace(CONFIG, scan_layers=scan_layers)
    model = gpt.make_stages(config, SPLIT)
    params = model.init(0)
    batch = gpt.example_batch(config, 4 * MICROBATCH)
    pipe = Pipeline(model.stages, jpipe.get_schedule(name, ranks, 4), make_mesh(ranks, 1))
    loss, grads = pipe.value_and_grad(pipe.pack(params), batch)
    with jax.default_device(jax.devices("cpu")[0]):
        reference = jpipe.reference_value_and_grad(model.stages, params, batch)
    return testing.compare((loss, pipe.unpack(grads)), reference)[1]


def main(argv=None) -> None:
    import argparse
    import contextlib
    import io

    from bench import docs

    parser = argparse.ArgumentParser(prog="python -m bench.scan_split")
    docs.add_flag(parser, DOCS_PAGE)
    args = parser.parse_args(argv)
    jpipe.use_cpu_devices(8)
    out = io.StringIO()
    with contextlib.redirect_stdout(_Tee(out)):
        report()
    if args.write_docs:
        docs.write(
            DOCS_PAGE, "scan-split", out.getvalue(), docs.command_line("bench.scan_split", argv)
        )
        print(f"wrote block 'scan-split' of {DOCS_PAGE}")


DOCS_PAGE = "docs/compiler-measurements.md"


class _Tee:
    """Writes to the real stdout and keeps a copy."""

    def __init__(self, copy):
        self.copy, self.out = copy, sys.stdout

    def write(self, text):
        self.copy.write(text)
        return self.out.write(text)

    def flush(self):
        self.out.flush()


def report() -> None:
    print(f"GPT {CONFIG}, stages {SPLIT}, microbatch {MICROBATCH} sequences\n")
    print("| blocks | stage | carry elements | I dots | W dots | I FLOPs | W FLOPs |")
    print("|---|---|---|---|---|---|---|")
    figures = {}
    for scan in (False, True):
        figures[scan] = stage_figures(scan)
        for s, row in enumerate(figures[scan]):
            print(
                f"| {'nn.scan' if scan else 'unrolled'} | {s} | {row['carry']:,} | "
                f"{row['I dots']} | {row['W dots']} | {row['I flops']:,} | {row['W flops']:,} |"
            )
    schedule = jpipe.get_schedule("zb_h1", 3, 6)
    print()
    for scan, rows in figures.items():
        costs = jpipe.Costs(**{p: tuple(float(r[p + " flops"]) for r in rows) for p in "FIW"})
        bubble = jpipe.simulate(schedule, costs).bubble_fraction
        total = sum(r["carry"] for r in rows)
        print(
            f"{'nn.scan' if scan else 'unrolled'}: carry {total:,} elements in all; "
            f"ZB-H1 (3 ranks, 6 microbatches) bubble with these FLOPs as costs {bubble:.4f}"
        )
        for name in ("1f1b", "zb_h1"):
            print(f"  {name}: max relative error {exactness(scan, name):.2e}")
    print(f"\nGPT {LARGE}, stages {LARGE_SPLIT}, microbatch {LARGE_MICROBATCH} sequences:")
    for scan in (False, True):
        rows = stage_figures(scan, LARGE, LARGE_SPLIT, LARGE_MICROBATCH)
        dots = [(r["I dots"], r["W dots"]) for r in rows]
        flops = [(r["I flops"], r["W flops"]) for r in rows]
        carry = [r["carry"] for r in rows]
        label = "nn.scan" if scan else "unrolled"
        print(f"{label}: carry per stage {carry}, I/W matmuls {dots}, I/W FLOPs {flops}")


if __name__ == "__main__":
    main()
