"""The slice carry: what a stage hands from one slice of a sequence to the next.

A sliced schedule (`jpipe.Schedule.slices`, Seq1F1B) cuts each sequence into
k slices along its tokens and runs each slice as a microbatch. A stage whose
work reaches across tokens, causal attention above all, needs what the
sequence's earlier slices left: their keys and values. Such a stage is
written with a fourth argument and a second result::

    def stage(params, x, inputs, carry):   # carry: what slices before left
        ...
        return y, carry                     # the carry the next slice gets

and declared with the carry's shapes (`jpipe.Pipeline`'s ``carries``, one
pytree of `jax.ShapeDtypeStruct` per stage, or None for a stage without
one). The first slice of every sequence gets zeros.

For the compiler a carried stage is a plain stage whose input is ``(x,
carry)`` and whose output is ``(y, carry)`` (`carried`): its F, I and W are
traced as any stage's (`jpipe.StageKernels`, with ``slice_carried``), so I
returns the gradient of the incoming carry beside the input's. The lowering
keeps the carry on the stage's rank, from a slice's F to the next slice's,
and the carry's gradient from a slice's I to the slice before's I, which
the validator orders (`jpipe.validate`, sequence slices); neither ever
leaves the rank.

Written for attention with `jpipe.models.attention.attention_over_carry`,
whose carry is each layer's key and value buffers over the whole sequence.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp


def carried(fn: Callable, stage: int) -> Callable:
    """``fn(params, x, inputs, carry) -> (y, carry)`` as a plain stage of ``(x, carry)``.

    The returned function takes ``(params, (x, carry), inputs)`` and returns
    ``(y, carry)``; it refuses, naming `stage`, a result that is not a pair.
    """

    def stage_fn(params, x_and_carry, inputs):
        x, carry = x_and_carry
        out = fn(params, x, inputs, carry)
        if not (isinstance(out, (tuple, list)) and len(out) == 2):
            raise ValueError(
                f"stage {stage} is declared with a slice carry, so it must return "
                f"(output, carry); it returned {type(out).__name__}"
            )
        return tuple(out)

    return stage_fn


def check_carry(stage: int, given, returned) -> None:
    """Refuses a stage whose returned carry is not shaped as the one it was given.

    The carry goes from each slice to the next, so what a slice returns must
    be what the next one takes: the same tree of the same shapes and dtypes,
    floating point (its gradient flows back to the slice before).
    """

    def show(tree) -> str:
        return str(jax.tree.map(lambda a: f"{jnp.dtype(a.dtype).name}{list(a.shape)}", tree))

    same = jax.tree.structure(given) == jax.tree.structure(returned) and all(
        (a.shape, a.dtype) == (b.shape, b.dtype)
        for a, b in zip(jax.tree.leaves(given), jax.tree.leaves(returned), strict=True)
    )
    if not same:
        raise ValueError(
            f"stage {stage} returns a carry of {show(returned)} but is declared with "
            f"{show(given)}: the carry a slice returns is the next slice's, so the two "
            "must match"
        )
    for path, a in jax.tree_util.tree_flatten_with_path(given)[0]:
        if not jnp.issubdtype(a.dtype, jnp.floating):
            raise ValueError(
                f"stage {stage}'s carry{jax.tree_util.keystr(path)} is "
                f"{jnp.dtype(a.dtype).name}: a carry must be floating point, since its "
                "gradient flows back to the slice before"
            )
