"""The collectives of a training step across ranks, and how long they take on an interconnect.

Under FSDP2 the fake step runs the all-gathers and reduce-scatters on a fake process group, and ``OpCounter``
records each one seen (``collective_of``) by its kind and the bytes of the whole tensor (all ranks' shards
together). DDP's gradient all-reduce runs in its C++ reducer, which a simulated step does not wrap, so an
estimate for DDP adds it: the trainable parameters' gradients once per optimizer step (Lightning skips the sync
on accumulating micro-batches), in DDP's buckets (``ddp_buckets``).

The time of one collective on ``n`` ranks follows nccl-tests' bus bandwidth: a ring all-gather or reduce-scatter
moves ``(n - 1) / n`` of the whole tensor through each rank's link, an all-reduce twice that, each after a fixed
latency (``Interconnect.seconds``). The figures come from one of two places:

- a run with a live process group measures its own (``measure_interconnect``: three collectives of two sizes
  each, before loading); gloo's kinds differ (on a 2-core EPYC its reduce-scatter ran at 0.4-0.6 GB/s, the
  all-gather and all-reduce at 1.0-1.45: ``benchmarks/collective_bandwidth.py``), so each has its own bandwidth;
- a named GPU (``devices.GPUS``) carries its intra-node figure from torch's NCCL cost model
  (``torch/_inductor/comm_analysis.py``: NVLink 370 GB/s on Hopper, 240 on Ampere, PCIe 24; PCIe 3.0, the T4's,
  half that) and NCCL's ring latency (``tuning.cc``: about 10 us on NVLink, 15 on PCIe). The H100, H200 and A100
  rows are SXM boards, whose GPUs NVLink joins; an L4 or RTX 4090 pair talks over PCIe.
"""

from __future__ import annotations

import math
import time
import warnings
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

ALL_GATHER, REDUCE_SCATTER, ALL_REDUCE = "all-gather", "reduce-scatter", "all-reduce"
KINDS = (ALL_GATHER, REDUCE_SCATTER, ALL_REDUCE)
CollectiveKey = tuple[str, int]  # (kind, bytes of the whole tensor: every rank's shard together)

# the c10d ops a step dispatches (torch.distributed's eager calls and the functional ones DTensor and compile use)
_OPS = {
    "_allgather_base_": ALL_GATHER,  # (output, input, ...): what FSDP2's all_gather_into_tensor dispatches
    "all_gather_into_tensor": ALL_GATHER,  # functional: (input, group_size, group_name) -> output
    "_reduce_scatter_base_": REDUCE_SCATTER,  # (output, input, ...)
    "reduce_scatter_tensor": REDUCE_SCATTER,  # functional: (input, op, group_size, group_name) -> output
    "allreduce_": ALL_REDUCE,  # ([tensors], ...)
    "all_reduce": ALL_REDUCE,  # functional: (input, op, group_name) -> output
}
COMMUNICATION_NAMESPACES = ("c10d", "_c10d_functional")

# DDP's defaults (torch.nn.parallel.DistributedDataParallel: bucket_cap_mb=25, the first bucket 1 MiB)
DDP_BUCKET = 25 * 2**20
DDP_FIRST_BUCKET = 2**20


def collective_of(func: Any, inputs: list[torch.Tensor], outputs: list[torch.Tensor]) -> CollectiveKey | None:
    """The kind of ``func`` (a c10d op) and the bytes of its whole tensor: the largest of its tensors (the
    all-gather's output, the reduce-scatter's input) or, for an all-reduce, its inputs; ``None`` for other ops
    (barriers, broadcasts, waits, the list forms no step of the package dispatches)."""
    kind = _OPS.get(func._overloadpacket.__name__)
    if kind is None:
        return None
    tensors = inputs if kind == ALL_REDUCE else inputs + outputs
    sizes = [t.numel() * t.element_size() for t in {id(t): t for t in tensors}.values()]
    if not sizes:
        return None
    return kind, sum(sizes) if kind == ALL_REDUCE else max(sizes)


def gradient_as_bucket_view(strategy: Any) -> bool:
    """Whether a DDP ``strategy`` (``lowprec_ddp``, Lightning's ``DDPStrategy``) makes the gradients views into
    its buckets (its ``gradient_as_bucket_view=True``, passed on to torch's ``DistributedDataParallel``): then the
    buckets are the gradients' only copy. ``False`` for any other strategy, and for a strategy name."""
    ddp_kwargs = getattr(strategy, "_ddp_kwargs", None)
    return isinstance(ddp_kwargs, dict) and bool(ddp_kwargs.get("gradient_as_bucket_view", False))


def ddp_buckets(gradient_bytes: int) -> list[int]:
    """The all-reduces DDP runs for ``gradient_bytes`` of gradients: a first bucket of 1 MiB, then 25 MiB ones."""
    if gradient_bytes <= 0:
        return []
    first = min(gradient_bytes, DDP_FIRST_BUCKET)
    rest = gradient_bytes - first
    full, last = divmod(rest, DDP_BUCKET)
    return [first] + [DDP_BUCKET] * full + ([last] if last else [])


def wire_bytes(kind: str, nbytes: int, ranks: int) -> float:
    """The bytes one rank's link carries for one collective over a ring of ``ranks``."""
    share = (ranks - 1) / ranks
    return nbytes * share * (2 if kind == ALL_REDUCE else 1)


@dataclass(frozen=True)
class Interconnect:
    """How fast ranks exchange tensors: bus bandwidth (bytes/s, as nccl-tests' "busbw") by collective kind, and
    the latency of one collective in seconds."""

    name: str
    bus_bandwidth: dict[str, float] = field(hash=False)
    latency: float
    measured: bool = False

    def seconds(self, kind: str, nbytes: int, ranks: int) -> float:
        """One collective of a whole tensor of ``nbytes`` over ``ranks`` ranks."""
        if ranks <= 1:
            return 0.0
        return self.latency + wire_bytes(kind, nbytes, ranks) / self.bus_bandwidth[kind]

    def describe(self) -> str:
        rates = ", ".join(f"{kind} {self.bus_bandwidth[kind] / 1e9:,.2f} GB/s" for kind in KINDS)
        how = "measured" if self.measured else "NCCL's figures"
        return f"{self.name} ({how}: {rates}; {self.latency * 1e6:,.0f} us each)"


def nccl_link(name: str, bus_gb: float, latency_us: float) -> Interconnect:
    """A named GPU's intra-node link: one bus bandwidth for every kind, as NCCL's ring runs them."""
    return Interconnect(name, dict.fromkeys(KINDS, bus_gb * 1e9), latency_us * 1e-6)


NVLINK_HOPPER = nccl_link("NVLink (Hopper)", 370.0, 10.0)
NVLINK_AMPERE = nccl_link("NVLink (Ampere)", 240.0, 10.0)
PCIE = nccl_link("PCIe 4.0", 24.0, 15.0)
PCIE_GEN3 = nccl_link("PCIe 3.0", 12.0, 15.0)  # half of PCIe 4.0's lanes' rate

MEASURED_BYTES = {"cpu": 8 * 2**20, "cuda": 64 * 2**20}  # the large size measured: whole tensors
SMALL_BYTES = 64 * 2**10  # the small one, for the latency
REPEATS = 3


def measure_interconnect(device: torch.device) -> Interconnect:
    """Time each kind of collective on the default process group at two sizes (``SMALL_BYTES`` and
    ``MEASURED_BYTES``, the best of ``REPEATS`` after one warm-up) and fit the latency and bus bandwidth; every
    rank must call it, and all get the slowest rank's figures. A tenth of a second on gloo, milliseconds on NCCL."""
    ranks = dist.get_world_size()
    large = MEASURED_BYTES.get(device.type, MEASURED_BYTES["cuda"])
    times = torch.zeros(len(KINDS), 2, dtype=torch.float64, device=device)
    for row, kind in enumerate(KINDS):
        for column, nbytes in enumerate((SMALL_BYTES, large)):
            times[row, column] = _best_seconds(kind, nbytes, ranks, device)
    dist.all_reduce(times, op=dist.ReduceOp.MAX)
    small, big = times.cpu().unbind(1)
    latency = max(0.0, min(float(s) for s in small))
    bandwidth = {}
    for kind, s, b in zip(KINDS, small.tolist(), big.tolist(), strict=True):
        moved = wire_bytes(kind, large, ranks) - wire_bytes(kind, SMALL_BYTES, ranks)
        bandwidth[kind] = moved / max(b - s, 1e-9)
    backend = dist.get_backend()
    plural = "s" if ranks != 1 else ""
    return Interconnect(f"{backend} between {ranks} rank{plural}", bandwidth, latency, measured=True)


def _best_seconds(kind: str, nbytes: int, ranks: int, device: torch.device) -> float:
    shard = math.ceil(nbytes / 4 / ranks)
    whole = torch.zeros(shard * ranks, dtype=torch.float32, device=device)
    part = torch.zeros(shard, dtype=torch.float32, device=device)
    run = {
        ALL_GATHER: lambda: dist.all_gather_into_tensor(whole, part),
        REDUCE_SCATTER: lambda: dist.reduce_scatter_tensor(part, whole),
        ALL_REDUCE: lambda: dist.all_reduce(whole),
    }[kind]
    best = math.inf
    with warnings.catch_warnings():  # torch 2.13 renames the tensor forms (all_gather_single); FSDP2 calls these
        warnings.simplefilter("ignore", FutureWarning)
        for attempt in range(REPEATS + 1):
            _synchronize(device)
            dist.barrier()
            started = time.perf_counter()
            run()
            _synchronize(device)
            if attempt:  # the first warms the transport up
                best = min(best, time.perf_counter() - started)
    return best


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def count_ddp_all_reduce(collectives: Counter[CollectiveKey], gradient_bytes: int) -> None:
    """Add DDP's gradient all-reduce of one optimizer step to ``collectives``."""
    for nbytes in ddp_buckets(gradient_bytes):
        collectives[(ALL_REDUCE, nbytes)] += 1
