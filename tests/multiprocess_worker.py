"""One process of a multi-process test (started by tests/test_multiprocess.py).

    python tests/multiprocess_worker.py MODE

Run under `jpipe.launch` (or with the same environment): it joins the others
with `jpipe.initialize_distributed` and then, by MODE:

* ``pipeline``: the checker's CLI with pipe 4 over all processes, then a
  host-aware mesh and `Pipeline.pack` (from only this process's stages) /
  `unpack` across processes (evaluation across processes, `Pipeline.loss`,
  is the trainer's, tested there); prints one
  ``RESULT {json}`` line.
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


def main(mode: str) -> int:
    import jax

    import jpipe

    jpipe.initialize_distributed()

    if mode == "pipeline":
        print("RESULT " + json.dumps(_pipeline()), flush=True)
        return 0
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
