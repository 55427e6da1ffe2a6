"""One stage as programs: what both lowerings build from the user's stage function.

- `jpipe.stage.manual`: the jaxpr toolkit (the one place that reads
  ``jax._src``) and tracing a stage as one device sees it, so a stage with its
  own collectives gets exact gradients;
- `jpipe.stage.pieces`: a stage's forward, input-gradient (I) and
  weight-gradient (W) pieces and their kernels (`StageKernels`), the loss
  (`WeightedLoss`);
- `jpipe.stage.contract`: what a stage must return and pass on, checked once
  before either lowering;
- `jpipe.stage.carry`: the slice carry of a sliced schedule's stages;
- `jpipe.stage.pack`: the parameters of a rank's stages packed into buckets.
"""
