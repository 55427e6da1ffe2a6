"""Moving values between the per-rank lowering's ranks, within a process or across processes.

The per-rank lowering (`jpipe.lower.mpmd.programs`) runs each rank's pieces on the rank's
own devices and hands values (activations, gradients, evicted residuals, the
loss) from one rank to another. A `Courier` does the handing:

- **Both ranks in this process**: `jax.device_put` onto the receiver's
  devices, asynchronous like any dispatch.
- **The ranks in different processes**: JAX's transfer API
  (`jax.experimental.transfer`). Each process starts one transfer server
  and learns the others' addresses through `jax.distributed`'s key-value
  store. The sender *offers* its arrays under an id (``await_pull``, which
  returns at once; the server sends them once they are computed) and the
  receiver *pulls* that id (``pull``, which also returns at once, with
  arrays that become ready when the bytes have arrived). Neither host
  thread waits, and neither device stream waits for the other's: unlike a
  collective (a two-device ``ppermute`` both processes call), a transfer
  is no rendezvous, so a sender never stalls until its receiver reaches
  the matching call. Ids are agreed without messages: every process walks
  the same op list, so a transfer's id is (the call's number, the op's
  position).

A call (a step, an evaluation) ends with `Courier.settle`: in a run of
several processes each waits for its own results and then for the others
at the coordination service's barrier, so that nothing after the call
starts while a peer still pulls from this process. Without it the trainer
hung at random steps (2 processes x 2 CPU devices, BPipe's 1F1B, jax
0.10.2: stuck in 6 of 7 runs of 20 to 80 steps; waiting only for its own
results, in 1 of 2; with the barrier, in none of 3 runs of 80 steps). Our
reading, not proven: the optimizer's update that follows is one program
over every device, whose collective (the gradient norm) blocks the
devices' execution threads until the other process joins, while that
process still waits for a transfer from this one. The barrier costs one
round trip to the coordinator a step, and the update needs every rank's
gradients anyway.

A rank's devices must all belong to one process (its pieces are single-
process programs); a mesh whose rank spans processes is refused by name.
When a peer dies, the coordination service stops the survivors within its
heartbeat timeout (`jpipe.runtime.distributed`), as for the SPMD lowering.
"""

from __future__ import annotations

import socket

import jax

_server = None  # this process's transfer server, started on first use
_calls = 0  # steps and evaluations begun in this process, over every Courier
_connections: dict[int, object] = {}  # process index -> connection to its server
_KEY = "jpipe/transfer-server/{}"
_TIMEOUT_MS = 120_000
_BARRIER_TIMEOUT_MS = 3_600_000  # a slow step; a lost peer ends the run sooner (heartbeats)


def _host_address() -> str:
    """The address the other processes can reach this one at (that of the coordinator link)."""
    from jax._src import distributed

    coordinator = distributed.global_state.coordinator_address or "127.0.0.1:0"
    host = coordinator.rsplit(":", 1)[0].strip("[]")
    if host in ("127.0.0.1", "localhost", "::1"):
        return "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:  # no packet is sent: this asks the kernel which interface routes there
            s.connect((host, 1))
            return s.getsockname()[0]
        except OSError:
            return socket.gethostbyname(socket.gethostname())


def _connection(process: int):
    """This process's connection to `process`'s transfer server (both started on first use)."""
    global _server
    from jax._src import distributed
    from jax.experimental import transfer

    client = distributed.global_state.client
    if client is None:
        raise ValueError(
            "moving values between processes needs jax.distributed to be initialized "
            "(jpipe.initialize_distributed())"
        )
    if _server is None:
        host = _host_address()
        _server = transfer.start_transfer_server(
            jax.local_devices()[0].client, f"{host}:0", [f"{host}:0"]
        )
        client.key_value_set(_KEY.format(jax.process_index()), _server.address())
    if process not in _connections:
        address = client.blocking_key_value_get(_KEY.format(process), _TIMEOUT_MS)
        _connections[process] = _server.connect(address)
    return _connections[process]


def process_of(mesh) -> int:
    """The one process whose devices make up `mesh`, or a refusal naming them."""
    processes = sorted({d.process_index for d in mesh.devices.flat})
    if len(processes) != 1:
        raise ValueError(
            f"a rank's devices span processes {processes}; under the per-rank lowering each "
            "rank's pieces run in one process, so put each pipeline rank's devices (its data, "
            "fsdp and tensor devices) on one host, e.g. make_mesh(..., across_hosts={'pipe': N})"
        )
    return processes[0]


class Courier:
    """Hands values between ranks, each rank's devices known by its process.

    Args:
      processes: the process of each rank (`process_of` of its sub-mesh).
    """

    def __init__(self, processes):
        self.processes = tuple(processes)
        self.here = jax.process_index()
        self.local = tuple(p == self.here for p in self.processes)
        self.single = jax.process_count() == 1
        self.call = 0  # the number of the current call (a step or an evaluation), process-wide
        self.transfers = 0  # values moved between processes in the current call
        for p in sorted(set(self.processes) - {self.here}):
            _connection(p)  # every server up and known before the first step

    def begin(self) -> None:
        """Starts a call (a step or an evaluation).

        Every process makes the same calls in the same order, whichever
        `Courier` (pipeline, batch shape) makes them, so a process-wide count
        numbers them alike everywhere and keeps ids of different couriers
        apart.
        """
        global _calls
        _calls += 1
        self.call = _calls
        self.transfers = 0

    def _id(self, key: int) -> int:
        return self.call * (1 << 32) + key

    def move(self, values, r_from: int, r_to: int, key: int, structs):
        """`values` of rank `r_from` as rank `r_to` holds them, wherever the two run.

        Returns the values on rank `r_to`'s devices where that rank is in
        this process, else None. `values` is read only where rank `r_from`
        is here (elsewhere pass None); `structs` say what rank `r_to`
        receives (shapes, dtypes and shardings). `key` tells this transfer
        from the call's others, the same in every process.
        """
        here_from, here_to = self.local[r_from], self.local[r_to]
        if here_from and here_to:
            return [jax.device_put(v, a.sharding) for v, a in zip(values, structs, strict=True)]
        if not structs:
            return [] if here_to else None
        if here_from:
            _server.await_pull(self._id(key), list(values))
            self.transfers += 1
            return None
        if here_to:
            self.transfers += 1
            return _connection(self.processes[r_from]).pull(self._id(key), list(structs))
        return None

    def settle(self, results) -> None:
        """Ends a call: in a run of several processes, waits until every process has its results.

        Blocks until this process's `results` are computed (so every value
        it pulled has landed), then meets the others at a barrier of the
        coordination service (so every value they pulled from here has left).
        """
        if self.single:
            return
        from jax._src import distributed

        jax.block_until_ready(results)
        distributed.global_state.client.wait_at_barrier(
            f"jpipe/call/{self.call}", _BARRIER_TIMEOUT_MS
        )

    def share(self, value, r_from: int, key: int, struct):
        """Rank `r_from`'s array `value`, in every process of the run.

        The process of `r_from` offers it to each other process and returns
        it; the others pull it as `struct` (its shape, dtype and where to put
        it) under ``key + their index``, so `key` needs as many free ids
        after it as there are processes.

        One copy crosses, from the owner's first device to the puller's
        first device of `struct`, and is placed from there: a pull takes as
        many buffers as its sharding has devices, which would not match the
        offer where the two ranks' meshes differ in size.
        """
        owner = self.processes[r_from]
        if self.local[r_from]:
            one = value.addressable_shards[0].data
            for p in range(jax.process_count()):
                if p != owner:
                    _server.await_pull(self._id(key + p), [one])
                    self.transfers += 1
            return value
        self.transfers += 1
        first = next(iter(struct.sharding.addressable_devices_indices_map(struct.shape)))
        one = jax.ShapeDtypeStruct(
            struct.shape, struct.dtype, sharding=jax.sharding.SingleDeviceSharding(first)
        )
        pulled = _connection(owner).pull(self._id(key + self.here), [one])[0]
        return jax.device_put(pulled, struct.sharding)
