"""What each op of a training step asks of the device: FLOPs, bytes moved, and whether it launches a kernel.

The same counting serves the fake step (``StepTracker`` hands each op to an ``OpCounter``) and real CPU runs
(``CountingMode``), so a prediction and a measurement count the same things. It follows
``torch.distributed._tools.RuntimeEstimator``'s roofline mode (``torch.utils._runtime_estimation``):

- **FLOPs** come from ``torch.utils.flop_counter.flop_registry`` (matmuls, convolutions, attention). The CPU
  flash attention a fake CPU step runs is counted with the registry's flash-attention formulas, halved when
  causal (FlashAttention skips the masked tiles; the registry counts the full square).
- **Bytes** are every distinct input read and every output written, broadcast (stride-0) dimensions once, as
  ``get_transfer_time`` counts them; except that ``copy_``/``fill_`` do not read their destination, and the
  gathers (``embedding``, ``index_select``, ``gather``, ``index``) read only the rows they return, not the whole
  table. An op that mutates its arguments and returns nothing (``_foreach_add_``) writes those arguments.
- **Kernel launches** are ops that write a tensor, except views (RuntimeEstimator's ``_VIEW_OPS`` and every op
  whose schema says view), allocations (``empty*``: no kernel) and communication, which is counted apart:
  ``OpProfile.collectives`` holds each all-gather, reduce-scatter and all-reduce by its whole tensor's bytes
  (``collectives.py``), for ``OpProfile.ranks`` ranks. A dispatch mode sees an op whole (what it runs
  inside runs below the mode), so each op seen is one kernel; ``linear`` and ``matmul``, which reach the mode
  only from inside another op's composite (bitsandbytes' 4-bit matmul), count their dot products.

One ``OpProfile`` holds a step as counts of kernels by (FLOP dtype, FLOPs, bytes, in the optimizer step, kind):
``kind``'s first word (``family``) is ``"attention"`` for the fused attention kernels (whose FLOP rate a CPU
measures apart: its flash attention runs far below its matmul rate), ``"matmul"`` for the matmuls and
``"kernel"`` for the rest; the call's label follows it (``kernel_replay.call_label``: the op, dtypes, shapes and
strides), from which the local CPU times the kernel at its own shapes. A call without a label (a list of tensors
among its arguments) keeps ``"attention"``, ``"matmul"`` or ``""``. Small (a few hundred distinct kinds),
linear in the number of identical blocks (``depth.py`` extrapolates it as it does bytes), and enough to predict
the step's time on any device afterwards (``step_time.py``).

- **Fresh pages**: the bytes of each new storage of at least ``FRESH_PAGES`` an op allocates (``OpProfile.fresh``
  per kernel, ``allocated_fresh`` for the allocations). glibc serves such blocks with a new ``mmap`` each time
  and hands them back on free, so on a CPU the kernel that first writes them waits for the OS to fault in and
  zero every page: 236 ms/GiB on a 2-core EPYC, 7x the time of writing pages already held (``devices.local_cpu``
  measures it). At a 49k vocabulary the fp32 logits and their gradient make a few GiB of them a step.
"""

from __future__ import annotations

import sys
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._runtime_estimation import _VIEW_OPS
from torch.utils.flop_counter import flop_registry

from pl_lowprec.memory.bnb_standin import decompose_gemm_4bit
from pl_lowprec.memory.collectives import COMMUNICATION_NAMESPACES, CollectiveKey, collective_of
from pl_lowprec.memory.kernel_replay import MATMULS, call_label
from pl_lowprec.memory.tracker import DECOMPOSE

aten = torch.ops.aten

OpKey = tuple[str, int, int, bool, str]  # (FLOP dtype, "" without; FLOPs; bytes; in the optimizer step; kind)
# glibc's mmap threshold at its highest (its dynamic threshold stops at 32 MiB on 64-bit): larger blocks get
# fresh pages on every allocation
FRESH_PAGES = 32 * 2**20


def family(kind: str) -> str:
    """The kind's first word: ``"attention"``, ``"matmul"``, ``"kernel"`` or ``""``; then the call's label."""
    return kind.partition(" ")[0]


def call_of(kind: str) -> str | None:
    """The call's label after the kind's first word (``kernel_replay.call_label``); ``None`` without one."""
    return kind.partition(" ")[2] or None


_ALLOCATIONS = {aten.empty, aten.empty_like, aten.empty_strided, aten.new_empty, aten.new_empty_strided}
_ALLOCATIONS |= {aten.empty_permuted, aten.resize_, aten.set_, aten.lift_fresh_copy, aten._local_scalar_dense}
_WRITE_ONLY = {aten.copy_, aten.fill_, aten.zero_, aten.uniform_, aten.normal_, aten.bernoulli_, aten.random_}
_GATHERS = {aten.embedding, aten.index_select, aten.gather, aten.index}
_NOT_DEVICE_WORK = ("_c10d_functional", "c10d", "_dtensor", "prim", "profiler")
_CONTRACTIONS = {aten.linear, aten.matmul}  # composites that reach a mode from another op's composite (DECOMPOSE)
_CAUSAL_ARGUMENT = {  # attention ops the registry has no formula for: (its formula's op, where is_causal is)
    aten._scaled_dot_product_flash_attention_for_cpu: (aten._scaled_dot_product_flash_attention, 4),
    aten._scaled_dot_product_flash_attention_for_cpu_backward: (
        aten._scaled_dot_product_flash_attention_backward,
        7,
    ),
}
ATTENTION = "attention"  # the kind of the fused attention kernels: their FLOP rate is not a matmul's on a CPU
MATMUL = "matmul"  # the kind of the matmuls: each kernel's FLOPs at the matmul rate, plus its latency on a CPU
KERNEL = "kernel"  # the kind of every other kernel whose call has a label (its kind is "" without one)
_ATTENTION_OPS = {op for op in flop_registry if "attention" in str(op)} | set(_CAUSAL_ARGUMENT)
DTYPE_NAMES = {
    torch.float32: "fp32",
    torch.float64: "fp32",  # rare; counted at the fp32 rate
    torch.bfloat16: "bf16",
    torch.float16: "fp16",
    torch.float8_e4m3fn: "fp8",
    torch.float8_e5m2: "fp8",
}


@dataclass
class OpProfile:
    """The kernels of one step: how many of each (FLOP dtype, FLOPs, bytes, whether in the optimizer step).
    ``compiled``: the forward and backward run as compiled graphs (``compile=``; ``step_time.py`` says what changes)."""

    counts: Counter[OpKey] = field(default_factory=Counter)
    compiled: bool = False
    fresh: dict[OpKey, int] = field(default_factory=dict)  # a kernel's new storages of FRESH_PAGES or more, per call
    allocated_fresh: int = 0  # the same bytes from the allocations (``empty*``), which launch no kernel
    collectives: Counter[CollectiveKey] = field(default_factory=Counter)  # (kind, whole tensor's bytes): how many
    ranks: int = 1  # the ranks the collectives run over

    @property
    def launches(self) -> int:
        return sum(self.counts.values())

    @property
    def optimizer_launches(self) -> int:
        """The optimizer step's kernels (per tensor, as torch's AdamW runs on a CPU)."""
        return sum(n for key, n in self.counts.items() if key[3])

    @property
    def flops(self) -> int:
        return sum(key[1] * n for key, n in self.counts.items())

    @property
    def bytes(self) -> int:
        return sum(key[2] * n for key, n in self.counts.items())

    @classmethod
    def line(cls, first: OpProfile, second: OpProfile, steps: int) -> OpProfile:
        """The profile ``steps`` along the line from ``first`` to ``second`` (``first + steps x (second - first)``):
        each step adds the same kernels, a block more (``depth.py``) or a micro-batch more (``accumulation.py``)."""
        keys = dict.fromkeys([*first.counts, *second.counts])  # in the order recorded: sums add up the same
        counts = {k: first.counts[k] + steps * (second.counts[k] - first.counts[k]) for k in keys}
        kept = Counter({k: n for k, n in counts.items() if n > 0})
        fresh = {k: n for k, n in {**first.fresh, **second.fresh}.items() if k in kept}
        allocated = max(0, first.allocated_fresh + steps * (second.allocated_fresh - first.allocated_fresh))
        links = dict.fromkeys([*first.collectives, *second.collectives])
        collectives = {k: first.collectives[k] + steps * (second.collectives[k] - first.collectives[k]) for k in links}
        return cls(
            kept,
            fresh=fresh,
            allocated_fresh=allocated,
            collectives=Counter({k: n for k, n in collectives.items() if n > 0}),
            ranks=second.ranks,
        )

    def copy(self) -> OpProfile:
        """A profile that later records do not change."""
        return replace(self, counts=Counter(self.counts), fresh=dict(self.fresh), collectives=Counter(self.collectives))


class OpCounter:
    """Adds each op it is shown (``record``) to ``profile``: the one counting code of fake and real steps."""

    def __init__(self) -> None:
        self.profile = OpProfile()
        self._works: dict[Any, str] = {}  # op -> "kernel", "composite" (a kernel unless it aliases) or "none"
        self._flops_by_label: dict[str, tuple[int, str]] = {}  # call label -> _flops: each block repeats its calls

    def record(self, func: Any, args: tuple, kwargs: dict | None, out: Any, in_optimizer_step: bool = False) -> None:
        work = self._works.get(func)
        if work is None:
            work = self._works[func] = _work(func)
        if work == "none":
            if getattr(func, "namespace", None) in COMMUNICATION_NAMESPACES:
                collective = collective_of(func, _tensors(args), _tensors(out))
                if collective is not None:
                    self.profile.collectives[collective] += 1
            elif func._overloadpacket in _ALLOCATIONS and not func._schema.is_mutable:
                self.profile.allocated_fresh += _fresh_bytes(_tensors(out))
            return
        written = _tensors(out)
        if not written and func._schema.is_mutable:  # in-place foreach ops return nothing
            written = _mutated(func, args)
        read = _tensors(args) + _tensors(kwargs.values() if kwargs else ())
        if not written or (work == "composite" and _aliases(written, read)):
            return
        packet = func._overloadpacket
        if packet in _WRITE_ONLY:
            read = read[1:]
        elif packet in _GATHERS:
            read = [t for t in read if not t.is_floating_point()] + written  # the indices and the rows returned
        nbytes = _bytes(read) + _bytes(written)
        label = call_label(func, args, kwargs)
        flops, dtype = self._flops_of_call(label, func, args, kwargs, out)
        family = ATTENTION if packet in _ATTENTION_OPS else MATMUL if flops and packet in MATMULS else KERNEL
        kind = f"{family} {label}" if label is not None else "" if family == KERNEL else family
        key = (dtype, flops, nbytes, in_optimizer_step, kind)
        self.profile.counts[key] += 1
        fresh = 0 if func._schema.is_mutable else _fresh_bytes(written)  # in place: pages it holds
        if fresh:
            self.profile.fresh[key] = max(fresh, self.profile.fresh.get(key, 0))

    def _flops_of_call(
        self, label: str | None, func: Any, args: tuple, kwargs: dict | None, out: Any
    ) -> tuple[int, str]:
        """``_flops``, once per call label in this count: the label holds the op and every argument's dtype, shape,
        strides and value (numbers passed as tensors or Scalars, which no formula reads, as one of their type). The
        formulas read shapes only, but for varlen attention's on real tensors (its ``cum_seq`` values; CUDA only):
        one count sees one kind of tensor, fake or real."""
        if label is None:
            return _flops(func, args, kwargs, out)
        known = self._flops_by_label.get(label)
        if known is None:
            known = self._flops_by_label[label] = _flops(func, args, kwargs, out)
        return known


def _fresh_bytes(written: list[torch.Tensor]) -> int:
    """The bytes of ``written``'s storages of ``FRESH_PAGES`` or more: an op that is not in place and returns no
    view (those return before) writes new storages."""
    storages = {s._cdata: s.nbytes() for s in (t.untyped_storage() for t in written)}
    return sum(n for n in storages.values() if n >= FRESH_PAGES)


def _work(func: Any) -> str:
    """Whether an op runs device work: not a view, an allocation or communication. An op a dispatch mode sees
    runs whole (a composite's parts run below the mode, unseen), so a composite is one kernel too unless it
    returns a view (``reshape`` of a contiguous tensor)."""
    if not isinstance(func, torch._ops.OpOverload) or func.namespace in _NOT_DEVICE_WORK:
        return "none"
    packet = func._overloadpacket
    if func.is_view or packet in _VIEW_OPS or packet in _ALLOCATIONS or torch.Tag.inplace_view in func.tags:
        return "none"
    if func in DECOMPOSE:  # its parts run under the mode instead, and are counted
        return "none"
    composite = torch._C._dispatch_has_kernel_for_dispatch_key(func.name(), "CompositeImplicitAutograd")
    return "composite" if composite else "kernel"


def _aliases(written: list[torch.Tensor], read: list[torch.Tensor]) -> bool:
    inputs = {t.untyped_storage()._cdata for t in read}
    return any(t.untyped_storage()._cdata in inputs for t in written)


def _flops(func: Any, args: tuple, kwargs: dict | None, out: Any) -> tuple[int, str]:
    packet = func._overloadpacket
    first = next((t for t in _tensors(args) if t.is_floating_point()), None)
    dtype = DTYPE_NAMES.get(first.dtype, "fp32") if first is not None else "fp32"
    if packet in _CONTRACTIONS:  # each output element is a dot product over the input's last dimension
        return 2 * out.numel() * args[0].shape[-1], dtype
    formula, causal_at = flop_registry.get(packet), None
    if formula is None and packet in _CAUSAL_ARGUMENT:
        registered, causal_at = _CAUSAL_ARGUMENT[packet]
        formula = flop_registry[registered]
    if formula is None:
        return 0, ""
    try:
        flops = int(formula(*args, **(kwargs or {}), out_val=out))
    except AssertionError:  # grouped-query attention: torch's formula wants as many key/value heads as queries
        flops = int(formula(*_heads_as_query(args), **(kwargs or {}), out_val=out))
    if causal_at is not None:
        causal = args[causal_at] if len(args) > causal_at else (kwargs or {}).get("is_causal", False)
        flops = flops // 2 if causal else flops
    return flops, dtype


def _heads_as_query(args: tuple) -> tuple:
    """Attention arguments with each 4-D key/value (and its gradient) as the shape it would have with its heads
    repeated to the query's: the work GQA does is that of full attention. torch 2.13's formulas count GQA
    themselves; torch 2.11's refuse it (their shape wrapper passes a ``torch.Size`` through as it is)."""
    heads = args[0].shape[1]
    return tuple(
        torch.Size((a.shape[0], heads, *a.shape[2:]))
        if isinstance(a, torch.Tensor) and a.dim() == 4 and a.shape[1] != heads
        else a
        for a in args
    )


def _tensors(value: Any) -> list[torch.Tensor]:
    """The distinct tensors of an op's arguments or outputs (one level of lists: foreach ops, ``cat``)."""
    found: list[torch.Tensor] = []
    items = value if isinstance(value, (tuple, list, type({}.values()))) else (value,)
    for item in items:
        if isinstance(item, torch.Tensor):
            found.append(item)
        elif isinstance(item, (tuple, list)):
            found.extend(t for t in item if isinstance(t, torch.Tensor))
    if len(found) > 1:
        unique = {id(t): t for t in found}
        return list(unique.values())
    return found


def _mutated(func: Any, args: tuple) -> list[torch.Tensor]:
    written = []
    for argument, value in zip(func._schema.arguments, args, strict=False):
        if argument.alias_info is not None and argument.alias_info.is_write:
            written += _tensors((value,))
    return written


def _bytes(tensors: list[torch.Tensor]) -> int:
    total = 0
    for tensor in tensors:
        numel = 1
        for size, stride in zip(tensor.shape, tensor.stride(), strict=True):
            if stride != 0:
                numel *= size
        total += numel * tensor.element_size()
    return total


class CountingMode(TorchDispatchMode):
    """Counts the ops of a real run with ``OpCounter`` (``counter.profile``); the ops ``estimate_memory``'s step
    runs as their composite (bitsandbytes' ``gemm_4bit``) run as it, so both count the same kernels. Set
    ``in_optimizer_step`` around the optimizer step (a callback's ``on_before_optimizer_step``), as the fake step
    marks it.

    Args:
        when: Count only while this returns true (e.g. inside a training step); every op runs either way.
    """

    def __init__(self, when: Callable[[], bool] | None = None) -> None:
        super().__init__()
        self.counter = OpCounter()
        self.when = when
        self.in_optimizer_step = False
        if "bitsandbytes" in sys.modules:  # only a run that imported it can call its ops
            decompose_gemm_4bit()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        impl = DECOMPOSE.get(func)
        if impl is not None:
            with self:
                return impl(*args, **(kwargs or {}))
        out = func(*args, **(kwargs or {}))
        if self.when is None or self.when():
            self.counter.record(func, args, kwargs, out, self.in_optimizer_step)
        return out
