"""How long one optimizer step takes on a device: a roofline over the kernels the simulated step runs.

Each kernel of the step (``op_counts.OpProfile``: its FLOPs, bytes and dtype) takes the longest of

- its FLOPs at the device's achievable matmul rate for its dtype (compute-bound),
- its bytes at the device's achievable memory bandwidth (memory-bound),
- on a GPU, the host's time to launch it (launch-bound: the GPU waits for Python and the dispatcher),

as ``torch.distributed._tools.RuntimeEstimator``'s roofline mode takes the first two. On a CPU the same cores
dispatch and compute, so the dispatch time adds to each kernel instead, and two rates are its own, measured
(``devices.local_cpu``): fused attention at its flash attention's FLOP/s (a tenth of its matmul rate), and each
matmul's fixed latency on top of its FLOPs. The step's time is the sum: eager PyTorch runs one kernel after
another. The local CPU goes further: it times each kernel at its own shapes (``kernel_replay.py``, as
RuntimeEstimator's operator-level benchmark mode does), where one rate per dtype missed LoRA's thin matmuls,
small attention, dequantization and conversions by 3-11x; the roofline stays for kernels too large to replay.
A timed kernel's time includes its bare dispatch, and the dispatch overhead is added to it as to every kernel:
about a microsecond counted twice.

Compiled (``compile=``, ``OpProfile.compiled``): on a GPU the blocks and the loss run as graphs whose kernels
inductor's generated code launches with no Python, dispatcher or autograd between them, so the host stays ahead
and no kernel waits for its launch: each costs its FLOPs or its bytes. The ops inductor fuses are counted with
the bytes they move eagerly (an upper bound: a fused kernel does not write its intermediates). On an H100 (torch
2.11, docs/benchmarks.md run 3) this predicted Llama-3.2-1B's compiled memory-saving step at 0.123 s against
0.125 measured, and Llama-3.1-8B's at 0.540 s against 0.430 (+26%); timed as eager steps, 0.295 and 0.777 s.

The optimizer step is simulated on CPU tensors, where torch's AdamW runs a dozen kernels per parameter tensor;
on CUDA it runs the same arithmetic as ``foreach`` kernels, each over a list of tensors: a few dozen launches
in all. So on a GPU the optimizer step's kernels are charged their bytes and FLOPs but no launch each.

On a CPU, a kernel's new storages of 32 MiB or more (``op_counts.FRESH_PAGES``) also cost the first write to
their fresh pages (``DeviceSpec.fresh_page_seconds``), unless its replay ran it whole and so paid them already.
At SmolLM2-135M's 49k vocabulary (2 blocks, 8 x 512 rows, fp32 logits) that was 1.5 s of a 6.1 s step. Where
they are a tenth of the step or more, the line names the glibc settings that keep freed blocks for reuse
(``KEEP_FREED_BLOCKS``, read at the process's start; ``benchmarks/host_allocator.py`` measures them).

Across ranks (DDP, FSDP2: ``OpProfile.collectives``, ``collectives.py``), each collective takes its latency and
its bytes on the wire at the interconnect's bus bandwidth. On a CPU they add to the step: gloo waits on the same
cores. On a GPU NCCL runs them on its own stream beside the kernels (FSDP2 gathers the next block while this one
computes, DDP reduces buckets during the backward), so the step grows only where they outlast the kernels, plus
the collectives nothing overlaps: the first all-gather, before any kernel (the largest: FSDP2's root, which
holds the embeddings), and the last reduction, after the backward (of the mean size). Without figures for the
interconnect (the local CPU outside a run: gloo's speed is measured by a run's own process group), the
collectives are counted but not timed, and the line says so.

Left out: offloading's host copies (on a side stream), the data loader and Lightning's loop. Assumed: the CUDA
step runs the kernels of the CPU step that is simulated (the same modules, autograd and attention; CUDA's SDPA
kernel in place of the CPU's).
"""

from __future__ import annotations

from dataclasses import dataclass

from pl_lowprec.memory.collectives import ALL_GATHER, Interconnect, wire_bytes
from pl_lowprec.memory.devices import DeviceSpec
from pl_lowprec.memory.kernel_replay import REPLAY_LIMIT
from pl_lowprec.memory.op_counts import ATTENTION, OpProfile, call_of, family

# glibc's settings that serve every block from the heap and keep its freed top (64 GiB), as jemalloc does
KEEP_FREED_BLOCKS = {"MALLOC_MMAP_MAX_": "0", "MALLOC_TRIM_THRESHOLD_": str(64 * 2**30)}
FRESH_HINT_SHARE = 0.1  # of the step: from here the line says how to keep the blocks


@dataclass(frozen=True)
class StepTime:
    """The predicted seconds of one optimizer step on ``device``, split by what bounds each kernel; with the
    step's kernel launches, FLOPs and bytes moved."""

    device: str
    seconds: float
    compute_bound: float
    memory_bound: float
    launch_overhead: float
    launches: int
    flops: int
    bytes: int
    optimizer_launches: int = 0
    foreach: bool = False  # the optimizer's per-tensor kernels run as a few foreach kernels (a GPU)
    timed_kernels: int = 0  # kernels timed on this CPU at their own shapes (kernel_replay.py), not on the roofline
    one_thread_kernels: int = 0  # of them, timed on one thread: torch's threads waited for busy cores
    fresh_pages: float = 0.0  # seconds of ``seconds`` the first writes to fresh pages take (a CPU)
    fresh_bytes: int = 0  # the bytes of those pages
    communication: float = 0.0  # seconds of ``seconds`` the collectives across ranks add
    collectives: int = 0  # how many a step runs
    collective_seconds: float = 0.0  # their own time, overlapped with the kernels or not
    wire_bytes: int = 0  # the bytes each rank's link carries for them
    interconnect: str = ""  # what they were timed on; "" where they were not timed

    def line(self) -> str:
        """One line for ``pl-lowprec estimate``."""
        total = self.seconds or 1.0
        parts = ", ".join(
            f"{name} {value:.3f} s ({value / total:.0%})"
            for name, value in (
                ("compute-bound", self.compute_bound),
                ("memory-bound", self.memory_bound),
                ("launch overhead", self.launch_overhead),
                *((("fresh pages", self.fresh_pages),) if self.fresh_pages else ()),
                *((("communication", self.communication),) if self.communication else ()),
            )
        )
        return (
            f"Predicted step time on {self.device}: {self.seconds:.3f} s ({parts}; {self.launches:,} kernels"
            f"{self._optimizer_part()}{self._timed_part()}, {_decimal(self.flops, 'FLOP')},"
            f" {_decimal(self.bytes, 'B')} moved{self._fresh_part()}){self._collectives_part()}"
        )

    def _collectives_part(self) -> str:
        if not self.collectives:
            return ""
        plural = "s" if self.collectives != 1 else ""
        what = f"{self.collectives:,} collective{plural}, {_decimal(self.wire_bytes, 'B')} through each rank's link"
        if not self.interconnect:
            return (
                f"; {what}, not timed: no figures for how this device's ranks talk (a run measures its own process"
                " group)"
            )
        hidden = self.collective_seconds - self.communication
        overlap = f", {duration(hidden)} of them beside the kernels" if hidden > 1e-9 else ""
        return f"; {what}: {duration(self.collective_seconds)} on {self.interconnect}{overlap}"

    def _fresh_part(self) -> str:
        if not self.fresh_pages:
            return ""
        part = f", {_decimal(self.fresh_bytes, 'B')} of them to fresh pages, whose first write the OS waits on"
        hint = self.keep_freed_blocks_hint()
        return f"{part}; {hint}" if hint else part

    def keep_freed_blocks_hint(self) -> str | None:
        """Where fresh pages are ``FRESH_HINT_SHARE`` of the step or more: the glibc settings that avoid them."""
        if not self.fresh_pages or self.fresh_pages < FRESH_HINT_SHARE * self.seconds:
            return None
        settings = " ".join(f"{name}={value}" for name, value in KEEP_FREED_BLOCKS.items())
        return f"start Python with {settings} to keep freed blocks for reuse"

    def _optimizer_part(self) -> str:
        if not (self.foreach and self.optimizer_launches):
            return ""
        return f" ({self.optimizer_launches:,} of them the optimizer's per-tensor ones, run as foreach kernels)"

    def _timed_part(self) -> str:
        if not self.timed_kernels:
            return ""
        busy = (
            f"; {self.one_thread_kernels:,} on one thread, as other processes kept its cores busy: upper bounds"
            if self.one_thread_kernels
            else ""
        )
        return f" ({self.timed_kernels:,} of them timed on this CPU at their own shapes{busy})"


def duration(seconds: float) -> str:
    """``seconds`` to three figures: 1.234 s, 12.3 ms, 45 us."""
    if seconds >= 1:
        return f"{seconds:.3f} s"
    return f"{seconds * 1e3:.3g} ms" if seconds >= 1e-3 else f"{seconds * 1e6:.3g} us"


def _decimal(value: float, unit: str) -> str:
    """``value`` with a decimal prefix: 173.50 TFLOP, 392.15 MB."""
    for factor, prefix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if value >= factor:
            return f"{value / factor:,.2f} {prefix}{unit}"
    return f"{value:,.0f} {unit}"


def predict_step_time(profile: OpProfile, device: DeviceSpec, interconnect: Interconnect | None = None) -> StepTime:
    """The roofline of every kernel of ``profile`` on ``device``, summed; on a device that times kernels at their
    shapes (the local CPU, ``kernel_replay.py``), each kernel's own time where it has one. The collectives across
    ranks run on ``interconnect`` (a run's measured one), else on ``device.interconnect``."""
    bandwidth = device.bandwidth * device.memory_efficiency
    seconds = {"compute": 0.0, "memory": 0.0, "launch": 0.0, "fresh": 0.0}
    timed, one_thread, timer = 0, 0, device.kernel_seconds
    fresh_bytes = profile.allocated_fresh if device.fresh_page_seconds else 0
    for key, count in profile.counts.items():
        dtype, flops, nbytes, in_optimizer_step, kind = key
        if not flops:
            on_flops = 0.0
        elif family(kind) == ATTENTION:
            on_flops = flops / device.attention_flops_per_second(dtype)
        else:
            on_flops = flops / device.flops_per_second(dtype) + device.matmul_latency.get(dtype, 0.0)
        on_bytes = nbytes / bandwidth
        bound, kernel = ("compute", on_flops) if on_flops >= on_bytes else ("memory", on_bytes)
        label = call_of(kind) if timer is not None else None
        measured = timer(label, kernel) if label is not None else None
        fresh = profile.fresh.get(key, 0) if device.fresh_page_seconds else 0
        if measured is not None:  # split as the roofline bounds it
            fresh = 0 if kernel <= REPLAY_LIMIT else fresh  # replayed whole: its own fresh pages are in its time
            kernel, timed = measured.seconds, timed + count
            one_thread += count * measured.one_thread
        fresh_bytes += count * fresh
        if not device.asynchronous:  # the CPU dispatches, then computes
            seconds[bound] += count * kernel
            seconds["launch"] += count * device.launch_overhead
        elif in_optimizer_step or profile.compiled or kernel >= device.launch_overhead:  # foreach, or compiled
            seconds[bound] += count * kernel
        else:  # the GPU waits for the host to launch it
            seconds["launch"] += count * device.launch_overhead
    seconds["fresh"] = fresh_bytes * device.fresh_page_seconds
    links = interconnect or device.interconnect
    talking = communication(profile, links, device.asynchronous, sum(seconds.values())) if links else (0.0, 0.0)
    seconds["communication"] = talking[0]
    return StepTime(
        device.name,
        sum(seconds.values()),
        seconds["compute"],
        seconds["memory"],
        seconds["launch"],
        profile.launches,
        profile.flops,
        profile.bytes,
        profile.optimizer_launches,
        device.asynchronous,
        timed,
        one_thread,
        seconds["fresh"],
        fresh_bytes,
        seconds["communication"],
        sum(profile.collectives.values()),
        talking[1],
        int(sum(n * wire_bytes(kind, size, profile.ranks) for (kind, size), n in profile.collectives.items())),
        links.name + (", measured" if links.measured else "") if links and profile.collectives else "",
    )


def communication(profile: OpProfile, links: Interconnect, overlapped: bool, kernels: float) -> tuple[float, float]:
    """The seconds the collectives add to a step of ``kernels`` seconds, and their own seconds: all of them where
    they wait on the cores that compute (a CPU); where they run beside the kernels (``overlapped``: a GPU), what
    outlasts the kernels plus what nothing overlaps: the first all-gather (FSDP2's root, with the embeddings: the
    largest) and one reduction of the mean size (the last, after the backward)."""
    each = {key: links.seconds(key[0], key[1], profile.ranks) for key in profile.collectives}
    total = sum(n * each[key] for key, n in profile.collectives.items())
    if not overlapped:
        return total, total
    gathers = [each[key] for key in profile.collectives if key[0] == ALL_GATHER]
    reductions = {key: n for key, n in profile.collectives.items() if key[0] != ALL_GATHER}
    calls = sum(reductions.values())
    exposed = max(gathers, default=0.0) + (sum(n * each[k] for k, n in reductions.items()) / calls if calls else 0.0)
    return min(total, max(0.0, total - kernels) + exposed), total
