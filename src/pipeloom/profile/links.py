"""What moving bytes between ranks costs on this machine: p2p and the data-parallel collectives
(a mixture of experts' all-to-alls are timed beside its ops: `layouts`).

Each is measured between two forked gloo ranks at two sizes — a tiny tensor for the latency and a
large one for the bandwidth — and fitted as time = latency + bytes / bandwidth, bytes being the
whole tensor's: p2p (`send`/`recv`), and the collectives the runtime runs over dp replicas — the
all-reduce of ZeRO-0's gradients, the reduce-scatter of ZeRO-1/2's (`zero.sum_into_shard`: over
gloo an all-reduce) and the all-gather of their new weights. dp = 2 is the most ranks a probe
forks; the tuner scales a collective to other dp by the ring algorithm: dp − 1 latencies and
2(dp − 1)/dp of the bytes per rank. Beside them, what an all-reduce started under the compute
takes from it (`contention_share`): the runtime starts each stage's sync under the device's
later ops, which on CPU ranks share the cores with gloo's sums.

A profile taken in one process (`profile --device cuda`: every stage and replica of a plan on the
one GPU) has no ranks to send between: a message is handed over as it is, and the replicas'
gradients are summed in place (`gradients.reduce_in_process`). There `in_process_links` times
what those cost on the device — a copy for p2p and the all-gather, an add for the all-reduce and
the reduce-scatter — by its own clock (CUDA events on a GPU), at the same two sizes.
"""

from __future__ import annotations

import gc
import multiprocessing
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

from pipeloom.profile_format import Link, Links
from pipeloom.runtime.local import meeting
from pipeloom.runtime.zero import sum_into_shard

__all__ = ["contention_share", "ping_seconds", "measure_links", "in_process_links"]

_SMALL, _LARGE = 16, 4 * 2**20
"""fp32 elements of the two sizes measured: 64 bytes (latency), 16 MiB (bandwidth)."""
_TIMEOUT_S = 120.0


def ping_seconds(rank: int, tensor: torch.Tensor, repeats: int = 5) -> float:
    """Median one-way time of `tensor` between ranks 0 and 1 of the current group (other ranks
    only join the barriers)."""

    def round_trip() -> None:
        if rank == 0:
            dist.send(tensor, 1)
            dist.recv(tensor, 1)
        elif rank == 1:
            dist.recv(tensor, 0)
            dist.send(tensor, 0)

    return _median_seconds(round_trip, repeats) / 2


COLLECTIVES = ("allreduce", "reduce_scatter", "all_gather")


def collective_seconds(name: str, elements: int, repeats: int = 5) -> float:
    """Median time of one collective over a whole fp32 tensor of `elements` across the group."""
    whole = torch.zeros(elements)
    share = torch.zeros(elements // dist.get_world_size())
    own = whole[dist.get_rank() * share.numel() :][: share.numel()]  # in place, as ZeRO's shard is
    run = {
        "allreduce": lambda: dist.all_reduce(whole),
        "reduce_scatter": lambda: sum_into_shard(whole, own),
        "all_gather": lambda: dist.all_gather_single(whole, share),
    }[name]
    return _median_seconds(run, repeats)


def _median_seconds(run: Callable[[], object], repeats: int) -> float:
    """The median time of `run` over `repeats`, the group meeting at a barrier before each."""
    samples = []
    for _ in range(repeats):
        dist.barrier()
        began = time.perf_counter()
        run()
        samples.append(time.perf_counter() - began)
    return statistics.median(samples)


def contention_share(elements: int, sync: float, repeats: int = 21) -> float:
    """The share of the time `sync` (s) of an all-reduce of `elements` that a matrix-product loop
    as long as it loses when the all-reduce runs beside it (started asynchronously, as the
    runtime starts a stage's sync under the device's later ops): 0 where the sums run elsewhere,
    1 where every ms of them is taken from the compute. Both ranks compute; rank 0's medians are
    kept."""
    whole, a, b = torch.zeros(elements), torch.randn(256, 256), torch.randn(256, 256)
    began = time.perf_counter()
    for _ in range(8):
        torch.mm(a, b)
    products = max(1, round(sync / ((time.perf_counter() - began) / 8)))

    def compute() -> float:
        began = time.perf_counter()
        for _ in range(products):
            torch.mm(a, b)
        return time.perf_counter() - began

    alone, beside = [], []
    for _ in range(repeats):
        dist.barrier()
        alone.append(compute())
        dist.barrier()
        work = dist.all_reduce(whole, async_op=True)
        beside.append(compute())
        work.wait()
    lost = statistics.median(beside) - statistics.median(alone)
    return min(1.0, max(0.0, lost / sync))


def measure_links(sizes: tuple[int, ...] = (_SMALL, _LARGE), repeats: int = 9) -> Links:
    """p2p between two ranks, each collective over two, and what an all-reduce takes from the
    compute beside it."""
    context = multiprocessing.get_context("fork")
    with tempfile.TemporaryDirectory(prefix="pipeloom-links-") as directory:
        processes = [context.Process(target=_link_rank, args=(r, directory, sizes, repeats)) for r in range(2)]
        for process in processes:
            process.start()
        for process in processes:
            process.join(_TIMEOUT_S)
        values = [float(x) for x in Path(directory, "links").read_text().split()]
    nbytes = [4 * n for n in sizes]
    contention = values.pop()
    rows = [values[i : i + len(sizes)] for i in range(0, len(values), len(sizes))]
    collectives = {name: _line(nbytes, row) for name, row in zip(COLLECTIVES, rows[1:])}
    return Links(p2p=_line(nbytes, rows[0]), dp=2, sync_contention=contention, **collectives)


def in_process_links(device: torch.device, sizes: tuple[int, ...] = (_SMALL, _LARGE), repeats: int = 9) -> Links:
    """What a plan run in one process on `device` pays to move its bytes: a copy (p2p, the
    all-gather) and an add (the all-reduce, the reduce-scatter: the replicas' sums)."""
    from pipeloom.runtime.clocks import clock_for

    clock = clock_for(device)
    rows: dict[str, list[float]] = {"copy": [], "add": []}
    for elements in sizes:
        source, target = torch.ones(elements, device=device), torch.zeros(elements, device=device)
        for name, work in (("copy", target.copy_), ("add", target.add_)):
            marks = []
            for _ in range(repeats + 1):  # the first one warms the allocator and the kernel up
                began = clock.mark()
                work(source)
                marks.append((began, clock.mark()))
            if device.type == "cuda":
                torch.cuda.synchronize(device)  # the events are read once the device has passed them
            rows[name].append(statistics.median(1e3 * clock.seconds(a, b) for a, b in marks[1:]))
    nbytes = [4 * n for n in sizes]
    copy, add = _line(nbytes, rows["copy"]), _line(nbytes, rows["add"])
    return Links(p2p=copy, allreduce=add, reduce_scatter=add, all_gather=copy, dp=2)


def _line(nbytes: list[int], ms: list[float]) -> Link:
    """latency + bytes / bandwidth through the smallest and largest size."""
    slope = (ms[-1] - ms[0]) / (nbytes[-1] - nbytes[0])
    latency = max(0.0, ms[0] - slope * nbytes[0])
    return Link(latency, 1 / slope if slope > 0 else float(nbytes[-1]) / max(ms[-1], 1e-6))


def _link_rank(rank: int, directory: str, sizes: tuple[int, ...], repeats: int) -> None:
    gc.freeze()  # the parent's heap stays out of this rank's collections (as `runtime.local`'s ranks)
    torch.set_num_threads(1)
    with meeting(rank, 2, directory, _TIMEOUT_S) as store:
        dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
        seconds = [ping_seconds(rank, torch.zeros(n), repeats) for n in sizes]
        collectives = {name: [collective_seconds(name, n, repeats) for n in sizes] for name in COLLECTIVES}
        seconds += [time for name in COLLECTIVES for time in collectives[name]]
        values = [1e3 * s for s in seconds] + [contention_share(sizes[-1], collectives["allreduce"][-1])]
        if rank == 0:
            Path(directory, "links").write_text(" ".join(str(value) for value in values))
        dist.destroy_process_group()
