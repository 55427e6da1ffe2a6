"""Draws a run's losses from its metrics.jsonl: the training batches' and the held-out ones.

python -m bench.loss_curve runs/bpe_8k/metrics.jsonl --png docs/bpe_8k.png --title "..."
"""

import argparse
import json


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("metrics", help="a run's metrics.jsonl")
    parser.add_argument("--png", required=True, help="where to write the figure")
    parser.add_argument("--title", default="", help="the figure's title")
    parser.add_argument("--unit", default="nats per token", help="the loss's unit, for the axis")
    args = parser.parse_args(argv)

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with open(args.metrics) as f:
        records = [json.loads(line) for line in f if line.strip()]
    train = sorted((r["step"], r["loss"]) for r in records if "loss" in r)
    held_out = sorted((r["step"], r["eval_loss"]) for r in records if "eval_loss" in r)
    fig, ax = plt.subplots(figsize=(6, 3.6), dpi=120)
    if train:
        ax.plot(*zip(*train), lw=1, alpha=0.6, label="training batch")
    if held_out:
        ax.plot(*zip(*held_out), "o-", lw=2, label="held-out")
        for step, loss in held_out:
            ax.annotate(
                f"{loss:.2f}",
                (step, loss),
                textcoords="offset points",
                xytext=(0, 6),
                ha="center",
                fontsize=7,
            )
    ax.set_xlabel("step")
    ax.set_ylabel(f"loss ({args.unit})")
    ax.set_title(args.title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(args.png)
    print(f"wrote {args.png}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
