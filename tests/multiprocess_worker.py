"""One process of a multi-process test (started by tests/test_multiprocess.py).

    python tests/multiprocess_worker.py MODE

Run under `jpipe.launch` (or with the same environment): it joins the others
with `jpipe.initialize_distributed` and then, by MODE:

* ``pipeline``: the checker's CLI with pipe 4 over all processes, then a
  host-aware mesh and `Pipeline.pack` (from only this process's stages) /
  `unpack` across processes (evaluation across processes, `Pipeline.loss`,
  is the trainer's, tested there); prints one
  ``RESULT {json}`` line.
* ``rank_meshes``: the per-rank lowering with one mesh per rank across the
  2 processes (ranks 0 and 1 of tensor 1 in process 0, rank 2 of tensor 2
  in process 1: stage 1's output is regrouped between the processes);
  prints the loss's and its ranks' gradients' error against the whole model.
* ``replicas``: the checker's CLI on Chimera (4 ranks, 2 per process) under
  each lowering: each stage's two copies are in different processes, so the
  copies' gradient sums and the last stage's loss sums cross between them;
  prints ``PASS`` twice from each process.
* ``raise``: process 1 raises; the others wait in a collective.
"""

import json
import sys


def _pipeline() -> dict:
    import jax
    import numpy as np

    import jpipe
    from jpipe import check, testing

    out = {"check": check.main(["1f1b", "--ranks", "4", "-m", "8"])}
    me = jax.process_index()
    mesh = jpipe.make_mesh(2, 2, across_hosts={"pipe": 2})
    out["pipe_processes"] = [sorted({d.process_index for d in row.flat}) for row in mesh.devices]
    mesh = jpipe.make_mesh(2, 2, across_hosts={"data": 2})
    out["data_processes"] = [sorted({d.process_index for d in row.flat}) for row in mesh.devices]
    mesh4 = jpipe.make_mesh(4, 1)
    out["pipe4_processes"] = [d.process_index for d in mesh4.devices.reshape(4, -1)[:, 0]]

    stages, params, _ = testing.small_model(4, seed=3)
    pipe = jpipe.Pipeline(stages, jpipe.get_schedule("1f1b", 4, 4), mesh4)
    # Packing reads only this process's ranks: the others' stages are mere shapes here.
    mine = {
        r
        for r, p in enumerate(d.process_index for d in mesh4.devices.reshape(4, -1)[:, 0])
        if p == me
    }
    shaped = [
        p if s in mine else jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), p)
        for s, p in enumerate(params)
    ]
    packed = pipe.pack(shaped)
    back = pipe.unpack(packed)
    out["unpack_equal"] = all(
        np.array_equal(a, np.asarray(b))
        for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(params))
    )
    out["local_rows"] = sorted(
        {s.index[0].start for v in packed.values() for s in v.addressable_shards}
    )
    out["process"] = me
    return out


def _rank_meshes() -> dict:
    import jax

    import jpipe
    from jpipe import models, testing
    from jpipe.models import gpt

    config = models.GPTConfig(
        vocab_size=32, seq_len=8, num_layers=4, num_heads=2, d_model=16, d_ff=32
    )
    meshes = jpipe.make_rank_meshes([{"tensor": 1}, {"tensor": 1}, {"tensor": 2}])
    model = models.make_stages(config, (1, 2, 1), tensor_axis="tensor")
    params = model.init(0)
    pipe = jpipe.Pipeline(model.stages, jpipe.get_schedule("1f1b", 3, 4), meshes, lowering="mpmd")
    packed = pipe.pack(params, gpt.tensor_specs(config, params))
    batch = models.example_batch(config, batch_size=8, seed=3)
    out = {"process": jax.process_index(), "ranks": [p is not None for p in packed]}
    for _ in range(2):  # the second step reuses every transfer's kind under new ids
        loss, grads = pipe.value_and_grad(packed, batch)
    whole = models.make_stages(config, (1, 2, 1))
    want_loss, want = jpipe.reference_value_and_grad(whole.stages, params, batch, 4)
    got = pipe.unpack(grads)
    mine = [s for s, g in enumerate(got) if g is not None]
    _, rel = testing.compare((loss, [got[s] for s in mine]), (want_loss, [want[s] for s in mine]))
    out.update(stages=mine, rel=float(rel))
    return out


def main(mode: str) -> int:
    import jax

    import jpipe

    jpipe.initialize_distributed()

    if mode == "pipeline":
        print("RESULT " + json.dumps(_pipeline()), flush=True)
        return 0
    if mode == "rank_meshes":
        print("RESULT " + json.dumps(_rank_meshes()), flush=True)
        return 0
    if mode == "replicas":
        from jpipe import check

        return max(
            check.main(["chimera", "-r", "4", "-m", "8", "--lowering", lowering])
            for lowering in ("spmd", "mpmd")
        )
    if mode == "raise":
        jax.devices()
        if jax.process_index() == 1:
            raise ValueError("a deliberate failure in process 1")
        jax.numpy.zeros(())  # the others go on to a collective that never completes
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices("never reached by process 1")
        return 0
    raise SystemExit(f"unknown mode {mode!r}")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
