"""The kernels of a step, timed on this CPU at their own shapes, where a roofline misses them.

A roofline holds for a CPU's large matmuls (within 20% from 512 wide, measured against each kernel of a real
step) but not for much else a fine-tune runs: a LoRA matmul with a side of 8 ran at 3-7x its roofline, flash
attention's FLOP rate moves 4x with its shape (28 GFLOP/s forward and backward in bf16 at 128 positions and head
size 32, 104 at 512 and 64), and bitsandbytes' dequantize, dtype conversions and the loss's log-softmax ran at
5-11x their bytes at the copy bandwidth. The quickstart's step took 3x its roofline, Llama-3.2-1B's blocks 1.6x.

So the step-time prediction on the local CPU (``devices.local_cpu``) times the kernels itself, as
``torch.distributed._tools.RuntimeEstimator``'s operator-level benchmark mode does: each op is called again on
random tensors of the recorded dtypes, shapes and strides, best of a few runs, once per process per call,
and on one thread too where other processes keep the cores busy (``timed_on_free_cores``).
``OpCounter`` records each kernel with its ``call_label``; ``kernel_seconds`` replays it. Integer tensors hold
ones (a valid index, target or mask), so gathers and the loss run as they would.

Bounded, so that estimating a large model on a laptop stays quick (Llama-3.1-8B's QLoRA step at 2 x 2048: 3.8 s
on a 2-core EPYC): a kernel whose roofline time is above ``REPLAY_LIMIT`` keeps it, which holds at that size,
except matmuls and attention, whose time is linear in their output's sides and in batch x heads: they run
smaller and are scaled (``_smaller``). A process spends at most ``REPLAY_BUDGET`` seconds replaying; after that
the roofline serves for calls not timed yet. The prediction says how many of its kernels were timed
(``StepTime.timed_kernels``).
"""

from __future__ import annotations

import ast
import functools
import math
import re
import time
import warnings
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch.utils._python_dispatch import _disable_current_modes

aten = torch.ops.aten

REPLAY_LIMIT = 0.01  # seconds: kernels the roofline puts above this keep it (attention is timed smaller, scaled)
REPLAY_BUDGET = 10.0  # seconds a process spends replaying kernels at most
REPLAY_BYTES = 256 * 2**20  # the most memory one replay materialises
MATMULS = {aten.mm, aten.addmm, aten.bmm, aten.baddbmm, aten.linear, aten.matmul}
ATTENTION_OPS = {
    aten._scaled_dot_product_flash_attention_for_cpu,
    aten._scaled_dot_product_flash_attention_for_cpu_backward,
}
_TENSOR = re.compile(r"^(\w+)\[([\d,]*)\]\(([\d,]*)\)$")
BUSY = 1.25  # torch's threads this much slower than one thread (its CPU time) ...
BUSY_WAIT = 0.0005  # ... and by this many seconds (a scheduler slice is milliseconds): other processes hold the cores
_TIMES: dict[tuple[str, int], KernelTime | None] = {}  # (label, share) -> its time, for the whole process
_spent = [0.0]  # seconds this process has replayed kernels for


def call_label(func: Any, args: tuple, kwargs: dict | None) -> str | None:
    """One op call as text that ``kernel_seconds`` can run again: the op, then each argument; a tensor as its
    dtype, shape and strides (``bfloat16[2048,512](512,1)``), a dtype as ``torch.bfloat16``, a device as
    ``'cpu'`` (replays run here), numbers, strings and lists of them as their ``repr``. ``None`` where an
    argument is none of these (a list of tensors, a generator): that kernel keeps the roofline."""
    positions, by_name = _schema_arguments(func)
    parts = [_op_name(func)]
    named = [(None, value, positions[i] if i < len(positions) else None) for i, value in enumerate(args)]
    named += [(name, value, by_name.get(name)) for name, value in (kwargs or {}).items()]
    for name, value, argument in named:
        text = _argument(_number_as_its_type(value, argument))
        if text is None:
            return None
        parts.append(text if name is None else f"{name}={text}")
    return " ".join(parts)


@functools.cache
def _op_name(func: Any) -> str:
    return str(func)


@functools.cache
def _schema_arguments(func: Any) -> tuple[list[Any], dict[str, Any]]:
    """``func``'s schema arguments in order and by name: read once per op, not once per call."""
    arguments = list(func._schema.arguments)
    return arguments, {argument.name: argument for argument in arguments}


def _number_as_its_type(value: Any, argument: Any) -> Any:
    """A number passed as a tensor or a Scalar (``x * 2.0``, ``add``'s ``alpha``) as one of its type: its value
    does not change the kernel's work, and LoRA's scaling then gives one label whatever ``lora_alpha`` is. A
    ``float`` or ``int`` argument (a dropout's ``p``, a dimension) keeps its value."""
    if argument is None or isinstance(value, bool) or not isinstance(value, (int, float)):
        return value
    if isinstance(argument.type, (torch.TensorType, torch.NumberType)):
        return type(value)(1)
    return value


def _argument(value: Any) -> str | None:
    if isinstance(value, torch.Tensor):
        dtype = str(value.dtype).removeprefix("torch.")
        return f"{dtype}[{','.join(map(str, value.shape))}]({','.join(map(str, value.stride()))})"
    if isinstance(value, (torch.dtype, torch.memory_format, torch.layout)):
        return str(value)
    if isinstance(value, torch.device):
        return "'cpu'"
    if value is None or isinstance(value, (bool, int, float)) or (isinstance(value, str) and " " not in value):
        text = repr(value)
    elif isinstance(value, (list, tuple)) and all(isinstance(v, (bool, int, float)) for v in value):
        text = repr(list(value)).replace(" ", "")
    else:
        return None
    return text if _reads_back(text) else None


@functools.lru_cache(maxsize=2**16)
def _reads_back(text: str) -> bool:
    """Whether ``text`` reads back as the value (inf and nan do not); parsed once per text: the same numbers and
    shapes come back at every call of a step."""
    try:
        ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return False
    return True


def forget_timings() -> None:
    """Drop the process's kernel times and replay budget, so the next prediction times every kernel afresh (a
    benchmark comparing two ways of timing)."""
    _TIMES.clear()
    _spent[0] = 0.0


def kernel_seconds(label: str, roofline: float) -> KernelTime | None:
    """The seconds the kernel of ``label`` takes on this CPU, timed at its shapes (``timed_on_free_cores``);
    ``None`` where the roofline (``roofline`` seconds) serves instead: too large to materialise, a call that
    cannot run again, or the process's ``REPLAY_BUDGET`` spent. Each call is timed once per process and reused
    after, also once the budget is spent, so a step predicted twice is predicted the same. Above
    ``REPLAY_LIMIT`` a matmul or attention runs smaller and is scaled (``_smaller``)."""
    key = (label, max(1, math.ceil(roofline / REPLAY_LIMIT)))
    if key not in _TIMES:
        if _spent[0] >= REPLAY_BUDGET:
            return None
        started = time.perf_counter()
        _TIMES[key] = _timed(*key)
        _spent[0] += time.perf_counter() - started
    return _TIMES[key]


def _timed(label: str, share: int) -> KernelTime | None:
    """``label``'s kernel timed once per process; with about ``1 / share`` of its work where ``share`` > 1, and
    the time scaled back by the fraction it ran."""
    try:
        op, args, kwargs = _parse(label)
        fraction = 1.0
        if share > 1:
            args, fraction = _smaller(op._overloadpacket, args, share)
            if fraction is None:
                return None
        tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, _TensorSpec)]
        if sum(t.nbytes for t in tensors) > REPLAY_BYTES:
            return None
        with _disable_current_modes(), torch.autocast("cpu", enabled=False), torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # what an op says about random values is not the run's concern
            generator = torch.Generator().manual_seed(0)
            real_args = [a.materialise(generator) if isinstance(a, _TensorSpec) else a for a in args]
            real_kwargs = {k: v.materialise(generator) if isinstance(v, _TensorSpec) else v for k, v in kwargs.items()}
            timed = timed_on_free_cores(lambda: op(*real_args, **real_kwargs), repeats=3, budget=3 * REPLAY_LIMIT)
        return timed._replace(seconds=timed.seconds / fraction)
    except Exception:  # any call that cannot run again here keeps the roofline, and is not counted as timed
        return None


def best_seconds(
    run: Callable[[], object],
    repeats: int = 5,
    budget: float = 0.1,
    clock: Callable[[], float] = time.perf_counter,
    warm_up: bool = True,
) -> float:
    """The fastest of ``repeats`` runs after a warm-up (unless ``run`` has just run), stopping early once
    ``budget`` seconds are spent; wall time, or ``clock``'s."""
    if warm_up:
        run()  # first-call allocations and kernel selection
    best, spent = float("inf"), 0.0
    for _ in range(repeats):
        started = clock()
        run()
        took = clock() - started
        best, spent = min(best, took), spent + took
        if spent > budget:
            break
    return best


class KernelTime(NamedTuple):
    """A kernel's seconds on this CPU; ``one_thread`` where torch's threads were slower than one thread alone
    (``timed_on_free_cores``), so the seconds are one thread's: an upper bound on the idle machine's."""

    seconds: float
    one_thread: bool = False


def timed_on_free_cores(run: Callable[[], object], repeats: int = 5, budget: float = 0.1) -> KernelTime:
    """``best_seconds`` on torch's threads; where there are several, twice more on one thread, by the CPU time
    of the thread that runs it (``time.thread_time``), which is taken when it is less by more than ``BUSY``
    times and ``BUSY_WAIT`` seconds.

    Why: a kernel split over threads waits at its end for the slowest one, so while other processes hold the
    cores each call waits out a scheduler slice, and no best-of-few escapes it. On a 2-core EPYC beside two busy
    processes, an add of 2**20 floats took 11 ms on 2 threads (46 us idle) and 93 us on one (85 us idle), a
    512-square matmul 20 ms (1.3 ms idle) and 2.5 ms; a prediction of 9 ms read 5 s. On one thread torch runs
    the kernel in the calling thread, whose CPU time leaves out the slices other processes took. One thread's
    time is at most the thread count too slow for a kernel that splits, and right for one that does not."""
    threads = torch.get_num_threads()
    seconds = best_seconds(run, repeats, budget)
    if threads == 1:
        return KernelTime(seconds)
    torch.set_num_threads(1)
    try:
        alone = best_seconds(run, 2, budget, clock=time.thread_time, warm_up=False)
    finally:
        torch.set_num_threads(threads)
    if seconds > BUSY * alone and seconds - alone > BUSY_WAIT:
        return KernelTime(alone, one_thread=True)
    return KernelTime(seconds)


class _TensorSpec:
    """A tensor argument as recorded: dtype, shape and strides, materialised as random values in that layout."""

    def __init__(self, dtype: torch.dtype, shape: tuple[int, ...], strides: tuple[int, ...]) -> None:
        self.dtype, self.shape, self.strides = dtype, shape, strides

    @property
    def span(self) -> int:
        """The elements of storage the layout reaches."""
        return 1 + sum((size - 1) * stride for size, stride in zip(self.shape, self.strides, strict=True) if size)

    @property
    def nbytes(self) -> int:
        return self.span * self.dtype.itemsize

    def resized(self, shape: tuple[int, ...]) -> _TensorSpec:
        """The same dimension order in memory (innermost stride first), dense, at ``shape``; a broadcast
        (stride-0) dimension stays broadcast."""
        order = sorted(range(len(shape)), key=lambda d: (self.strides[d], self.shape[d]))
        strides, step = [0] * len(shape), 1
        for d in order:
            if self.strides[d] == 0 and self.shape[d] > 1:
                continue
            strides[d], step = step, step * max(shape[d], 1)
        return _TensorSpec(self.dtype, shape, tuple(strides))

    def materialise(self, generator: torch.Generator) -> torch.Tensor:
        """Random values (ones where not floating point: valid indices and masks), filled through the storage,
        since a broadcast (stride-0) layout cannot be written through."""
        storage = torch.empty(self.span, dtype=self.dtype)
        if storage.is_floating_point():
            storage.normal_(generator=generator)
        else:
            storage.fill_(1)
        return storage.as_strided(self.shape, self.strides)


def _parse(label: str) -> tuple[Any, list[Any], dict[str, Any]]:
    name, *tokens = label.split(" ")
    op = functools.reduce(getattr, name.split("."), torch.ops)
    args: list[Any] = []
    kwargs: dict[str, Any] = {}
    for token in tokens:
        key, value = None, token
        head, _, tail = token.partition("=")
        if tail and head.isidentifier():
            key, value = head, tail
        parsed = _value(value)
        if key is None:
            args.append(parsed)
        else:
            kwargs[key] = parsed
    return op, args, kwargs


def _value(text: str) -> Any:
    if text.startswith("torch."):
        return getattr(torch, text.removeprefix("torch."))
    match = _TENSOR.match(text)
    if match is None:
        return ast.literal_eval(text)
    dtype, shape, strides = match.groups()
    return _TensorSpec(
        getattr(torch, dtype),
        tuple(int(s) for s in shape.split(",") if s),
        tuple(int(s) for s in strides.split(",") if s),
    )


# Where each output dimension of a matmul sits in its arguments: (argument, dimension), the first one
# deciding its size. Time grows linearly with any of them once they are a few hundred long.
_OUTPUT_DIMENSIONS = {
    aten.mm: ([(0, 0)], [(1, 1)]),
    aten.addmm: ([(1, 0), (0, -2)], [(2, 1), (0, -1)]),
    aten.bmm: ([(0, 0), (1, 0)], [(0, 1)], [(1, 2)]),
    aten.baddbmm: ([(1, 0), (2, 0), (0, 0)], [(1, 1), (0, 1)], [(2, 2), (0, 2)]),
    aten.linear: ([(0, 0)], [(1, 0), (2, 0)]),
}
SMALLEST_SIDE = 256  # a matmul's output side is not shrunk below this: smaller ones run at another rate


def _smaller(op: Any, args: list[Any], share: int) -> tuple[list[Any], float | None]:
    """``op``'s arguments with about ``1 / share`` of its work, and the fraction kept (``None``: it cannot
    shrink, or is neither a matmul nor attention). Attention keeps fewer rows and heads (``_fewer_heads``); a
    matmul shortens its output's longest sides, down to ``SMALLEST_SIDE``."""
    if op not in _OUTPUT_DIMENSIONS:
        return _fewer_heads(args, share) if op in ATTENTION_OPS else (args, None)
    shapes = [list(a.shape) if isinstance(a, _TensorSpec) else None for a in args]
    sides = []
    for places in _OUTPUT_DIMENSIONS[op]:
        arg, dim = places[0]
        if shapes[arg] is not None and len(shapes[arg]) > dim:
            sides.append((shapes[arg][dim], places))
    fraction, left = 1.0, float(share)
    for size, places in sorted(sides, key=lambda side: -side[0]):
        kept = max(min(size, SMALLEST_SIDE), math.ceil(size / left))
        if kept >= size:
            continue
        for arg, dim in places:
            shape = shapes[arg] if arg < len(shapes) else None
            if shape is not None and -len(shape) <= dim < len(shape) and shape[dim] == size:
                shape[dim] = kept
        fraction, left = fraction * kept / size, left * kept / size
        if left <= 1:
            break
    if fraction >= 1.0:
        return args, None
    resized = [
        a.resized(tuple(shape)) if isinstance(a, _TensorSpec) and list(a.shape) != shape else a
        for a, shape in zip(args, shapes, strict=True)
    ]
    return resized, fraction


def _fewer_heads(args: list[Any], share: int) -> tuple[list[Any], float | None]:
    """Attention's arguments with about ``1 / share`` of its work, and the fraction kept (``None`` where one head
    of one row is all there is). Every tensor is batch x heads x ...; the work is in units of one row's key/value
    head with its query heads (grouped-query attention keeps its ratio), and fewer units keep fewer rows first."""
    multi_head = [a.shape[1] for a in args if isinstance(a, _TensorSpec) and len(a.shape) >= 3 and a.shape[1] > 1]
    batch = next(a for a in args if isinstance(a, _TensorSpec)).shape[0]
    groups = min(multi_head, default=1)  # key/value heads
    kept = max(1, batch * groups // share)
    kept_batch, kept_groups = (kept // groups, groups) if kept >= groups else (1, kept)
    fraction = kept_batch * kept_groups / (batch * groups)
    if fraction >= 1.0:
        return args, None
    resized = []
    for a in args:
        if isinstance(a, _TensorSpec) and len(a.shape) >= 3:
            heads = a.shape[1] if a.shape[1] == 1 else a.shape[1] * kept_groups // groups
            a = a.resized((min(a.shape[0], kept_batch), heads, *a.shape[2:]))
        resized.append(a)
    return resized, fraction
