"""The unpipelined model: one jitted `value_and_grad` on the whole batch.

`one_device` is the baseline every ratio in the table is taken against.
`one_device_microbatched` does the same work one microbatch at a time (a
`lax.map` over microbatches, differentiated): the cost of cutting the batch,
without any pipeline. On a CPU, where small matrix products run well below
the peak of large ones, this alone can cost more than data parallelism.
`data_parallel` runs the same function with the batch split over the devices
and the parameters replicated; XLA inserts the gradient all-reduce. On fake
CPU devices, which share the host's cores, it cannot be faster than one
device, and it is the practical limit for any multi-device program there.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jpipe
from bench.workloads import Workload


class Program(NamedTuple):
    """Something with ``.lower(*args)`` (a `jax.jit` or a `jpipe.Pipeline`) and its placed args."""

    lowerable: Any
    args: tuple


def _loss_and_params(workload: Workload, num_stages: int):
    stage_fns, params = workload.stages(num_stages)

    def loss(params_list, batch):
        return jpipe.run_stages(stage_fns, params_list, batch)

    return loss, params


def one_device(workload: Workload, num_microbatches: int, num_stages: int, device) -> Program:
    """`jax.jit(jax.value_and_grad(loss))` with everything on `device`."""
    loss, params = _loss_and_params(workload, num_stages)
    batch = workload.batch(num_microbatches)
    params, batch = jax.device_put((params, batch), device)
    return Program(jax.jit(jax.value_and_grad(loss)), (params, batch))


def one_device_microbatched(
    workload: Workload, num_microbatches: int, num_stages: int, device
) -> Program:
    """The mean of the microbatch losses, one microbatch after another, on `device`."""
    loss, params = _loss_and_params(workload, num_stages)

    def mean_loss(params_list, batch):
        mbs = jpipe.microbatches(batch, num_microbatches)
        return jax.lax.map(lambda mb: loss(params_list, mb), mbs).mean()

    batch = workload.batch(num_microbatches)
    params, batch = jax.device_put((params, batch), device)
    return Program(jax.jit(jax.value_and_grad(mean_loss)), (params, batch))


def data_parallel(workload: Workload, num_microbatches: int, num_stages: int, devices) -> Program:
    """The same step, batch split over ``data`` (all `devices`), parameters replicated."""
    loss, params = _loss_and_params(workload, num_stages)
    batch = workload.batch(num_microbatches)
    mesh = Mesh(list(devices), ("data",), axis_types=(AxisType.Auto,))
    rows = jax.tree.leaves(batch)[0].shape[0]
    if rows % len(devices):
        raise ValueError(f"a batch of {rows} rows cannot be split over {len(devices)} devices")
    replicated, split = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))
    params = jax.device_put(params, replicated)
    batch = jax.device_put(batch, split)
    fn = jax.jit(
        jax.value_and_grad(loss),
        in_shardings=(replicated, split),
        out_shardings=(replicated, replicated),
    )
    return Program(fn, (params, batch))
