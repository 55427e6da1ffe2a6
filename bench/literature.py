"""The literature's schedules beside their papers' own formulas: simulated bubble and memory.

    python -m bench.literature [--write-docs]

For each built-in taken from a paper (so far `chimera`, Li and Hoefler,
SC'21), at R = 4 and 8 ranks and M = 8 and 32 microbatches, the simulator's
bubble fraction and each rank's peak live activations and parameters,
beside what the paper's formula says and beside 1F1B on the same ranks.
Pure Python (`jpipe.simulate`): no devices, a second or two.

Costs are the paper's unit slots (F = B = 1, where its formula holds) and
the usual B = 2F (F = I = W = 1). Memory is in units of one stage's: a
microbatch's residuals at one stage (activation = 1) and one stage's
parameters (params = 1); a stage is 1/R of the model in both schedules.
``--write-docs`` replaces block ``literature`` of docs/schedules.md.
"""

from __future__ import annotations

import argparse

import jpipe
from jpipe import Costs, Sizes

UNIT = Costs(F=1, I=1, W=0)  # F = B = 1: the paper's slots
USUAL = Costs()  # F = I = W = 1, B = 2F
SIZES = Sizes(activation=1, params=1)


def chimera_rows(ranks=(4, 8), microbatches=(8, 32)) -> list[dict]:
    """One dict per (R, M): `chimera`'s simulated figures, the paper's, and 1F1B's."""
    rows = []
    for R in ranks:
        for M in microbatches:
            chimera = jpipe.get_schedule("chimera", R, M)
            base = jpipe.get_schedule("1f1b", R, M)
            sim = jpipe.simulate(chimera, UNIT, SIZES)
            rows.append(
                {
                    "R": R,
                    "M": M,
                    "bubble_unit": sim.bubble_fraction,
                    "bubble_paper": (R - 2) / (2 * M + R - 2),
                    "bubble_usual": jpipe.simulate(chimera, USUAL).bubble_fraction,
                    "bubble_1f1b_usual": jpipe.simulate(base, USUAL).bubble_fraction,
                    "peak_live": (min(sim.peak_activations), max(sim.peak_activations)),
                    "peak_live_paper": (R // 2 + 1, R),
                    "peak_live_1f1b": max(jpipe.simulate(base, UNIT).peak_activations),
                    "params": max(len(chimera.stages_of(r)) for r in range(R)),
                }
            )
    return rows


def table(rows: list[dict]) -> str:
    """The rows as the Markdown table docs/schedules.md shows."""
    lines = [
        "| R | M | bubble, F = B: simulated | paper (R-2)/(2M+R-2) | bubble, B = 2F "
        "| 1F1B, B = 2F | peak live a rank | paper (M = R) | 1F1B's fullest | parameters a rank |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['R']} | {r['M']} | {r['bubble_unit']:.4f} | {r['bubble_paper']:.4f} "
            f"| {r['bubble_usual']:.4f} | {r['bubble_1f1b_usual']:.4f} "
            f"| {r['peak_live'][0]}-{r['peak_live'][1]} "
            f"| {r['peak_live_paper'][0]}-{r['peak_live_paper'][1]} | {r['peak_live_1f1b']} "
            f"| {r['params']} stages |"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--write-docs", action="store_true", help="replace block 'literature' of docs/schedules.md"
    )
    args = parser.parse_args(argv)
    text = table(chimera_rows())
    print(text)
    if args.write_docs:
        from bench import docs

        docs.write(
            "docs/schedules.md", "literature", text, docs.command_line("bench.literature", argv)
        )
        print("wrote block 'literature' of docs/schedules.md")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
