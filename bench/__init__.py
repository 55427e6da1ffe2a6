"""Benchmarks: jpipe against the unpipelined model and today's SPMD pipeline.

Run ``python -m bench`` (``--help`` for the options). On a CPU it fakes as
many devices as the pipeline has ranks; on a GPU or TPU with enough devices it
uses the real ones. Every row of the table is one way of computing the loss
and gradients of the same model on the same global batch:

- ``one device``: one `jax.jit` of `jax.value_and_grad` on one device, the
  baseline every ratio is taken against;
- ``one device, microbatched``: the same work one microbatch after another,
  the cost of cutting the batch without any pipeline;
- ``data parallel``: the same jitted function with the batch split over all
  devices and the parameters replicated, the practical limit;
- ``peer gpipe`` (and ``peer circular``): the SPMD pipeline JAX users have
  today (`bench.baselines.spmd_pipeline`), GPipe by differentiating a loop;
- ``jpipe <schedule>``: `jpipe.Pipeline` with a built-in schedule.

The modules, one pass each:

- `bench.workloads`: the models, cut into stages for jpipe and into
  embed / stacked blocks / head for the peer;
- `bench.baselines`: the unpipelined rows and the peer;
- `bench.rows`: every row as a program to compile, with its facts;
- `bench.measure`: compiling, `memory_analysis()`, interleaved timing;
- `bench.profile`: per-stage F, I, W costs on one device, for the simulator;
- `bench.run`: the main table (issue 5); `bench.compiler`: the compiler's
  memory, compile-time and overhead figures (issue 3);
- `bench.report`: JSON, Markdown and a plot.

``python -m bench --quick`` (a tiny GPT, 4 and 16 microbatches) takes about
two minutes on a 2-core machine; ``tests/test_bench.py`` runs it on the tiny
dense model. The full table takes about 15 minutes, ``--suite compiler``
about 4.

Microbatches keep a fixed size: with M microbatches of B rows the global
batch is M * B rows, and each group of rows with the same M has its own
one-device baseline.
"""
