"""The lowerings: a validated schedule and its stages turned into JAX programs on a mesh.

- `jpipe.lower.interface`: the seam. `LoweringKind` says what a lowering is
  (its traits, read by the trainer, the search and the planner, never its
  name); `Lowering` is what `Pipeline` hands a step to;
- `jpipe.lower.pipeline`: `Pipeline` (validates once, places parameters,
  checks batches, delegates), `make_mesh`, `run_stages` and the unpipelined
  reference;
- `jpipe.lower.microbatch`: the microbatch cut both lowerings and the
  reference share;
- `jpipe.lower.bytes`: the contract of a lowering's byte model (what each
  rank holds in, bytes per device out), which the search and the planner call;
- `jpipe.lower.spmd`: one SPMD program for every rank (ticks, slots, the
  table, the program and its one jit);
- `jpipe.lower.mpmd`: one program per rank and piece (the op order, the
  per-rank programs, transfers between ranks and processes).

A third lowering is a `LoweringKind` in `jpipe.lower.interface.KINDS`, a
`Lowering` subclass and a byte model in a folder of its own here.
"""
