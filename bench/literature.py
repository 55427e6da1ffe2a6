"""The literature's schedules beside their papers' own formulas: simulated bubble and memory.

    python -m bench.literature [--write-docs]

For the built-ins taken from papers that replicate stages (`chimera`, Li
and Hoefler, SC'21; `dualpipe`, DeepSeek-V3) or slice sequences (`seq1f1b`,
Sun et al., NAACL'25), at R = 4 and 8 ranks, the
simulator's bubble (or idle time a rank) and each rank's peak live
activations and parameters, beside what the paper's formula says and
beside 1F1B (and ZB-H1) on the same ranks. Pure Python (`jpipe.simulate`):
no devices, a second or two.

Costs are the paper's unit slots (F = B = 1, where its formula holds) and
the usual B = 2F (F = I = W = 1). Memory is in units of one stage's: a
microbatch's residuals at one stage (activation = 1) and one stage's
parameters (params = 1); a stage is 1/R of the model in both schedules.
``--write-docs`` replaces blocks ``literature``, ``literature-dualpipe`` and
``literature-seq1f1b`` of docs/schedules.md.
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


def dualpipe_rows(ranks=(4, 8), microbatches=(8, 32)) -> list[dict]:
    """One dict per (R, M): `dualpipe`'s idle time a rank at the usual costs (F = I =
    W = 1), DeepSeek-V3's formula for it, and 1F1B's and ZB-H1's beside. An M below
    dualpipe's least, 2R, is taken as 2R."""
    F, I, W = USUAL.F, USUAL.I, USUAL.W
    B = I + W
    rows = []
    for R in ranks:
        for M in dict.fromkeys(max(M, 2 * R) for M in microbatches):
            sims = {
                name: jpipe.simulate(jpipe.get_schedule(name, R, M), USUAL, SIZES)
                for name in ("dualpipe", "1f1b", "zb_h1")
            }
            idle = {k: max(s.makespan - b for b in s.busy) for k, s in sims.items()}
            d = sims["dualpipe"]
            rows.append(
                {
                    "R": R,
                    "M": M,
                    "idle": idle["dualpipe"],
                    "idle_paper": (R / 2 - 1) * ((F + B) + B - 3 * W),
                    "idle_1f1b": idle["1f1b"],
                    "idle_zb_h1": idle["zb_h1"],
                    "peak_live": max(d.peak_activations),
                    "peak_live_paper": R + 1,
                    "params": max(len(d.schedule.stages_of(r)) for r in range(R)),
                }
            )
    return rows


def dualpipe_table(rows: list[dict]) -> str:
    """`dualpipe_rows` as the Markdown table docs/schedules.md shows."""
    lines = [
        "| R | M | idle a rank: simulated | DeepSeek-V3 (R/2-1)(F&B+B-3W) | 1F1B | ZB-H1 "
        "| peak live a rank | DeepSeek-V3 (R+1) | parameters a rank |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['R']} | {r['M']} | {r['idle']:g} | {r['idle_paper']:g} | {r['idle_1f1b']:g} "
            f"| {r['idle_zb_h1']:g} | {r['peak_live']} | {r['peak_live_paper']} "
            f"| {r['params']} stages |"
        )
    return "\n".join(lines)


def seq1f1b_rows(ranks=(4, 8), microbatches=(8, 32), slices=(2, 4)) -> list[dict]:
    """One dict per (R, M, k): `seq1f1b`'s simulated bubble and rank 0's peak residuals
    (in sequences: a slice's are 1/k of its sequence's, and costs 1/k of a sequence's at
    B = 2F), beside 1F1B over k M units and 1F1B itself."""
    rows = []
    for R in ranks:
        for M in microbatches:
            base = jpipe.simulate(jpipe.get_schedule("1f1b", R, M), USUAL, SIZES)
            for k in slices:
                costs = Costs(F=1 / k, I=1 / k, W=1 / k)
                sizes = Sizes(activation=1 / k, params=0)
                sim = jpipe.simulate(jpipe.get_schedule("seq1f1b", R, M, slices=k), costs, sizes)
                rows.append(
                    {
                        "R": R,
                        "M": M,
                        "k": k,
                        "bubble": sim.bubble_fraction,
                        "bubble_formula": (R - 1) / (k * M + R - 1),
                        "bubble_1f1b": base.bubble_fraction,
                        "peak": sim.peak_bytes[0],
                        "peak_formula": min(M * k, R + k - 1) / k,
                        "peak_1f1b": base.peak_bytes[0] - 1,  # less its one stage's params
                    }
                )
    return rows


def seq1f1b_table(rows: list[dict]) -> str:
    """`seq1f1b_rows` as the Markdown table docs/schedules.md shows."""
    lines = [
        "| R | M | slices k | bubble, B = 2F: simulated | 1F1B over kM slices (R-1)/(kM+R-1) "
        "| 1F1B | rank 0's peak residuals, sequences | (R+k-1)/k | 1F1B's (R) |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['R']} | {r['M']} | {r['k']} | {r['bubble']:.4f} | {r['bubble_formula']:.4f} "
            f"| {r['bubble_1f1b']:.4f} | {r['peak']:.3g} | {r['peak_formula']:.3g} "
            f"| {r['peak_1f1b']:g} |"
        )
    return "\n".join(lines)


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
        "--write-docs",
        action="store_true",
        help="replace the blocks 'literature', 'literature-dualpipe' and "
        "'literature-seq1f1b' of docs/schedules.md",
    )
    args = parser.parse_args(argv)
    tables = {
        "literature": table(chimera_rows()),
        "literature-dualpipe": dualpipe_table(dualpipe_rows()),
        "literature-seq1f1b": seq1f1b_table(seq1f1b_rows()),
    }
    for name, text in tables.items():
        print(text, end="\n\n")
        if args.write_docs:
            from bench import docs

            command = docs.command_line("bench.literature", argv)
            docs.write("docs/schedules.md", name, text, command)
            print(f"wrote block {name!r} of docs/schedules.md")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
