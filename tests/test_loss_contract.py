"""One contract for both lowerings: what a stage may return, and 64-bit mode.

The last stage returns its microbatch's loss (a float scalar, or a
`jpipe.WeightedLoss` of two); every value between stages is floating point.
A stage that breaks either rule is refused before anything compiles, with
the same `ValueError` naming the stage under the SPMD and the per-rank
lowering (before, the per-rank one died inside JAX, or ran an int32 loss
to a wrong figure). Both lowerings also run a float32 model with
``jax_enable_x64`` on, exactly.
"""

import json
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jpipe

WIDTH, ROWS, M = 4, 2, 2

# A last stage that takes stage 0's float output and returns a good loss.
GOOD_LAST = lambda p, x, inputs: jnp.mean((x @ p) ** 2)  # noqa: E731
TANH = lambda p, x, inputs: jnp.tanh(inputs["x"] @ p)  # noqa: E731

ACTIVATION_RULE = (
    "values between stages must be floating point, so that gradients can flow back through "
    "them; integer data a later stage needs (token ids, masks, targets) reaches it through "
    "the batch, which every stage receives as its inputs"
)
LOSS_RULE = (
    "stage 1, the last stage, must return its microbatch's loss as one float scalar, or a "
    "jpipe.WeightedLoss(total, weight) of two float scalars; it returns "
)

# (stage 0, stage 1, the whole message): each way to break the contract.
BAD = {
    "loss per row": (
        TANH,
        lambda p, x, inputs: jnp.sum((x @ p) ** 2, axis=-1),
        LOSS_RULE + "float32[2] (one value per row or position? reduce it to the microbatch's "
        "loss, e.g. with jnp.mean, or return jpipe.WeightedLoss(jnp.sum(...), count) for a "
        "weighted mean)",
    ),
    "int32 loss": (
        TANH,
        lambda p, x, inputs: jnp.sum(x @ p > 0).astype(jnp.int32),
        LOSS_RULE + "int32[] (an integer or boolean loss has no gradient: compute it in "
        "floating point)",
    ),
    "tuple loss": (
        TANH,
        lambda p, x, inputs: (jnp.mean(x @ p), jnp.mean(x)),
        LOSS_RULE + "a tuple of 2: [0] float32[], [1] float32[] (return the loss alone, or "
        "jpipe.WeightedLoss(total, weight) for a loss that is a sum over a count)",
    ),
    "weighted loss with an int weight": (
        TANH,
        lambda p, x, inputs: jpipe.WeightedLoss(jnp.sum(x @ p), jnp.int32(ROWS)),
        LOSS_RULE + "a WeightedLoss of 2: .total float32[], .weight int32[]",
    ),
    "int32 activation": (
        lambda p, x, inputs: (inputs["x"] @ p > 0).astype(jnp.int32),
        lambda p, x, inputs: jnp.mean(x.astype(jnp.float32) @ p),
        "stage 0 passes int32[2, 4] to stage 1; " + ACTIVATION_RULE,
    ),
    "int leaf between stages": (
        lambda p, x, inputs: {
            "h": jnp.tanh(inputs["x"] @ p),
            "n": jnp.ones((ROWS,), jnp.int32),
        },
        lambda p, x, inputs: jnp.mean(x["h"] @ p) + 0 * jnp.sum(x["n"]),
        "stage 0 passes int32[2] at ['n'] to stage 1; " + ACTIVATION_RULE,
    ),
}


def _pipeline(stages, lowering):
    pipe = jpipe.Pipeline(
        list(stages), jpipe.get_schedule("1f1b", 2, M), jpipe.make_mesh(2, 1), lowering=lowering
    )
    params = [jnp.eye(WIDTH) * 0.5, jnp.ones((WIDTH, WIDTH)) * 0.1]
    x = np.random.default_rng(0).normal(size=(M * ROWS, WIDTH)).astype(np.float32)
    batch = jax.device_put({"x": x}, pipe.batch_sharding)
    return pipe, pipe.pack(params), batch


@pytest.mark.parametrize("case", list(BAD))
@pytest.mark.parametrize("lowering", jpipe.LOWERINGS)
def test_a_broken_contract_is_refused_alike_by_both_lowerings(case, lowering):
    first, last, message = BAD[case]
    pipe, packed, batch = _pipeline((first, last), lowering)
    with pytest.raises(ValueError) as step:
        pipe.value_and_grad(packed, batch)
    assert str(step.value) == message
    # The forward-only loss is refused with the same words.
    with pytest.raises(ValueError) as loss:
        pipe.loss(packed, batch)
    assert str(loss.value) == message


@pytest.mark.parametrize("lowering", jpipe.LOWERINGS)
def test_the_contract_holds_for_a_good_model_and_its_loss_is_exact(lowering):
    # The same two stages with a float activation and a float scalar loss run,
    # to the unpipelined mean over microbatches.
    pipe, packed, batch = _pipeline((TANH, GOOD_LAST), lowering)
    loss, grads = pipe.value_and_grad(packed, batch)
    params = pipe.unpack(packed)
    x = np.asarray(batch["x"]).reshape(M, ROWS, WIDTH)

    def mean_loss(params):
        return jnp.mean(
            jnp.stack([jpipe.run_stages([TANH, GOOD_LAST], params, {"x": x[m]}) for m in range(M)])
        )

    want_loss, want_grads = jax.value_and_grad(mean_loss)(params)
    np.testing.assert_allclose(loss, want_loss, rtol=1e-6)
    for got, want in zip(pipe.unpack(grads), want_grads):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7)


# Both lowerings under jax_enable_x64, in a process of its own (the flag is
# global, and the SPMD lowering's first program, the in-place probe, is cached
# per process). The hand-written schedule runs every memory action (host
# offload, eviction to a partner, a forward that keeps nothing); the SPMD
# program is checked with both controls, and zbv with the control it chooses.
X64_SCRIPT = textwrap.dedent(
    """
    import json, sys
    import jax
    jax.config.update("jax_enable_x64", True)
    import jpipe
    from jpipe import testing
    jpipe.use_cpu_devices(8)
    every_action = jpipe.Schedule.of([
        "0F0 0OFFLOAD_START0 0F1 0EVICT1@1 0OFFLOAD_END0 0RELOAD_START0 0RELOAD_END0 "
        "0B0 0LOAD1@1 0B1".split(),
        "1FC0 1F1 1RECOMPUTE0 1B0 1I1 1W1".split(),
    ])
    runs = [
        ("every action", every_action, "spmd", "cond"),
        ("every action", every_action, "spmd", "switch"),
        ("every action", every_action, "mpmd", "auto"),
        ("zbv", jpipe.get_schedule("zbv", 2, 4), "spmd", "auto"),
    ]
    _, params, _ = testing.small_model(2)
    out = []
    for name, schedule, lowering, control in runs:
        r = testing.check_schedule(schedule, data=2, lowering=lowering, control=control)
        out.append([name, lowering, control, r.passed, r.max_rel_err])
    dtypes = sorted({str(a.dtype) for a in jax.tree.leaves(params)})
    print(json.dumps({"x64": jax.config.jax_enable_x64, "dtypes": dtypes, "runs": out}))
    """
)


@pytest.mark.slow
def test_both_lowerings_run_a_float32_model_exactly_with_x64_enabled():
    proc = subprocess.run(
        [sys.executable, "-c", X64_SCRIPT], capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["x64"] is True and report["dtypes"] == ["float32"], report
    assert len(report["runs"]) == 4
    for name, lowering, control, passed, rel in report["runs"]:
        assert passed and rel <= 1e-5, (name, lowering, control, rel)
