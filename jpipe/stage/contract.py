"""The stage contract: what a stage may return, checked once for both lowerings.

Both lowerings (the SPMD program, `jpipe.lower.spmd.program.build_step`, and the per-rank
programs, `jpipe.lower.mpmd.programs.RankPrograms`) run the same traced pieces
(`jpipe.StageKernels`) and rely on the same two rules about them:

- **The last stage returns its microbatch's loss**: one float scalar, or a
  `jpipe.WeightedLoss(total, weight)` of two float scalars. The pipeline's
  loss is the mean of those scalars over microbatches (or the summed totals
  over the summed weights), and each microbatch's backward starts from its
  scalar's seed (`jpipe.stage.pieces.loss_seed`). A loss per row, a tuple of
  losses or an integer count has no such seed.
- **Values between stages are floating point**, every leaf of them, since
  the backward carries a cotangent of each leaf to the stage before. An
  integer leaf would have a `float0` cotangent, which neither lowering
  can move. Integer data a later stage needs (token ids, masks, targets)
  reaches it through the batch: every stage receives the microbatch's
  inputs.

Each lowering calls `check_stage_outputs` first thing, on the kernels it is
given, so a stage that breaks a rule is refused with the same `ValueError`,
naming the stage, whichever lowering runs it (and before either compiles).
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp

from jpipe.stage.pieces import StageKernels, WeightedLoss

LOSS_RULE = (
    "must return its microbatch's loss as one float scalar, or a "
    "jpipe.WeightedLoss(total, weight) of two float scalars"
)
"""What the last stage must return, as the refusal words it."""

ACTIVATION_RULE = (
    "values between stages must be floating point, so that gradients can flow back "
    "through them; integer data a later stage needs (token ids, masks, targets) "
    "reaches it through the batch, which every stage receives as its inputs"
)
"""What may pass between stages, as the refusal words it."""


def _leaf(a) -> str:
    """One value's dtype and shape, as ``float32[4, 8]`` (``float32[]`` a scalar)."""
    return f"{jnp.dtype(a.dtype).name}[{', '.join(map(str, a.shape))}]"


def describe_value(tree) -> str:
    """A stage output for an error: ``float32[4]``, or ``a tuple of 2: [0] float32[], ...``."""
    paths, treedef = jax.tree_util.tree_flatten_with_path(tree)
    if treedef.num_nodes == 1 and treedef.num_leaves == 1:  # a single array
        return _leaf(paths[0][1])
    kind = type(tree).__name__
    parts = ", ".join(f"{jax.tree_util.keystr(p) or '(root)'} {_leaf(a)}" for p, a in paths)
    return f"a {kind} of {len(paths)}: {parts}" if paths else f"an empty {kind}"


def _loss_hint(y, leaves: list) -> str:
    """Why the last stage's output is not a loss, where one reason is plain."""
    if len(leaves) == 1:
        (a,) = leaves
        if a.shape and jnp.issubdtype(a.dtype, jnp.floating):
            return (
                " (one value per row or position? reduce it to the microbatch's loss, "
                "e.g. with jnp.mean, or return jpipe.WeightedLoss(jnp.sum(...), count) "
                "for a weighted mean)"
            )
        if not jnp.issubdtype(a.dtype, jnp.floating):
            return " (an integer or boolean loss has no gradient: compute it in floating point)"
    elif not isinstance(y, WeightedLoss):
        return (
            " (return the loss alone, or jpipe.WeightedLoss(total, weight) for a loss "
            "that is a sum over a count)"
        )
    return ""


def check_stage_outputs(kernels: Sequence[StageKernels]) -> None:
    """Refuses stages that break the contract (module docstring), naming the stage.

    Checks, in stage order, that every value a stage passes to the next is
    floating point in every leaf, then that the last stage returns a float
    scalar or a `jpipe.WeightedLoss` of two. Pure shape checks on the
    traced kernels: nothing is compiled or run.

    Raises:
      ValueError: the first stage that breaks a rule, what it returns and
        the rule.
    """
    S = len(kernels)
    for s, k in enumerate(kernels[:-1]):
        for path, leaf in jax.tree_util.tree_flatten_with_path(k.out)[0]:
            if not jnp.issubdtype(leaf.dtype, jnp.floating):
                where = f" at {jax.tree_util.keystr(path)}" if path else ""
                raise ValueError(
                    f"stage {s} passes {_leaf(leaf)}{where} to stage {s + 1}; " + ACTIVATION_RULE
                )
    y = kernels[-1].out
    weighted = jax.tree.structure(y) == jax.tree.structure(WeightedLoss(0.0, 0.0))
    leaves = jax.tree.leaves(y)
    if (
        len(leaves) != (2 if weighted else 1)
        or any(leaf.shape != () for leaf in leaves)
        or not all(jnp.issubdtype(leaf.dtype, jnp.floating) for leaf in leaves)
    ):
        raise ValueError(
            f"stage {S - 1}, the last stage, {LOSS_RULE}; it returns {describe_value(y)}"
            + _loss_hint(y, leaves)
        )
