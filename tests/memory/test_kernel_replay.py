"""The local CPU times the step's matmul and attention kernels at their own shapes (``memory/kernel_replay.py``)."""

import time
from collections import Counter

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from pl_lowprec.demo import TinyLlama
from pl_lowprec.memory import devices, kernel_replay
from pl_lowprec.memory.devices import DeviceSpec, local_cpu
from pl_lowprec.memory.estimate import estimate_memory
from pl_lowprec.memory.kernel_replay import (
    SMALLEST_SIDE,
    KernelTime,
    _parse,
    _smaller,
    _TensorSpec,
    call_label,
    kernel_seconds,
    timed_on_free_cores,
)
from pl_lowprec.memory.op_counts import MATMUL, OpProfile
from pl_lowprec.memory.step_time import predict_step_time


class _Recorder(TorchDispatchMode):
    """Each replayable call with its output: what a label has to rebuild."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, torch.Tensor]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func._overloadpacket in kernel_replay.MATMULS | kernel_replay.ATTENTION_OPS:
            first = out[0] if isinstance(out, tuple) else out
            self.calls.append((call_label(func, args, kwargs), first))
        return out


def _record(run) -> list[tuple[str, torch.Tensor]]:
    with _Recorder() as recorder:
        run()
    return recorder.calls


def _matmuls_and_attention() -> None:
    x = torch.randn(64, 32, dtype=torch.bfloat16)
    x.t() @ x  # a transposed operand
    torch.addmm(torch.randn(16), torch.randn(8, 32), torch.randn(32, 16))
    torch.bmm(torch.randn(2, 8, 32), torch.randn(32, 16).expand(2, -1, -1))  # a broadcast batch
    nn.functional.linear(torch.randn(2, 8, 32), torch.randn(16, 32), torch.randn(16))
    q, k, v = (torch.randn(2, 4, 16, 8, requires_grad=True) for _ in range(3))
    out = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    torch.autograd.grad(out, (q, k, v), out)


def test_a_call_label_runs_the_same_op_again_with_the_same_dtypes_shapes_and_strides():
    calls = _record(_matmuls_and_attention)
    ops = Counter(label.split(" ")[0] for label, _ in calls)
    assert set(ops) == {
        "aten.mm.default",
        "aten.addmm.default",
        "aten.bmm.default",
        "aten._scaled_dot_product_flash_attention_for_cpu.default",
        "aten._scaled_dot_product_flash_attention_for_cpu_backward.default",
    }, ops
    transposed = next(label for label, _ in calls if label.startswith("aten.mm"))
    assert transposed == "aten.mm.default bfloat16[32,64](1,32) bfloat16[64,32](32,1)"
    x, w, bias = torch.randn(2, 8, 32), torch.randn(16, 32), torch.randn(16)
    linear = torch.ops.aten.linear.default  # reaches a mode only from bitsandbytes' 4-bit matmul's composite
    calls.append((call_label(linear, (x, w, bias), None), linear(x, w, bias)))
    for label, out in calls:
        op, args, kwargs = _parse(label)
        real = [a.materialise(torch.Generator()) if isinstance(a, _TensorSpec) else a for a in args]
        assert call_label(op, tuple(real), kwargs) == label  # dtypes, shapes, strides and the other arguments
        again = op(*real, **kwargs)
        again = again[0] if isinstance(again, tuple) else again
        assert (again.shape, again.dtype) == (out.shape, out.dtype), label


def test_other_kernels_have_labels_too_unless_an_argument_cannot_be_written_down(monkeypatch):
    monkeypatch.setattr(kernel_replay, "_spent", [0.0])  # whatever this worker's earlier tests replayed
    x = torch.randn(4, 8, dtype=torch.bfloat16)
    to_float = torch.ops.aten._to_copy.default
    label = call_label(to_float, (x,), {"dtype": torch.float32, "device": torch.device("cpu")})
    assert label == "aten._to_copy.default bfloat16[4,8](8,1) dtype=torch.float32 device='cpu'"
    op, args, kwargs = _parse(label)
    assert op(args[0].materialise(torch.Generator()), **kwargs).dtype == torch.float32
    softmax = torch.ops.aten._log_softmax.default
    assert _parse(call_label(softmax, (x, -1, False), None))[1][1:] == [-1, False]
    scaled = [call_label(torch.ops.aten.mul.Tensor, (x, alpha / 8), None) for alpha in (16, 32)]
    assert scaled[0] == scaled[1] == "aten.mul.Tensor bfloat16[4,8](8,1) 1.0"  # LoRA's scaling: the same work
    dropout = torch.ops.aten.native_dropout.default
    assert call_label(dropout, (x, 0.1, True), None) != call_label(dropout, (x, 0.2, True), None)  # a float kept
    assert call_label(torch.ops.aten.cat.default, ([x, x],), None) is None  # a list of tensors
    assert call_label(torch.ops.aten.clamp.default, (x, float("-inf")), None) is None  # -inf does not come back
    assert kernel_seconds(label, 1e-6).seconds > 0


def test_the_prediction_takes_the_devices_own_time_for_each_labelled_kernel():
    label = "aten.mm.default bfloat16[64,32](32,1) bfloat16[32,16](16,1)"
    counts = Counter({("bf16", 10**9, 10**3, False, f"{MATMUL} {label}"): 3, ("bf16", 10**9, 10**3, False, MATMUL): 2})
    asked = []

    def kernel_time(asked_label: str, roofline: float) -> KernelTime:
        asked.append((asked_label, roofline))
        return KernelTime(0.5)

    device = DeviceSpec("cpu", {"bf16": 1e12}, bandwidth=1e12, launch_overhead=0.0, matmul_efficiency=1.0)
    roofline = predict_step_time(OpProfile(counts), device)
    assert roofline.compute_bound == pytest.approx(5e-3) and roofline.timed_kernels == 0
    timed = predict_step_time(OpProfile(counts), DeviceSpec(**{**device.__dict__, "kernel_seconds": kernel_time}))
    assert timed.compute_bound == pytest.approx(3 * 0.5 + 2 * 1e-3)  # the label's 3 measured, the rest roofline
    assert asked == [(label, pytest.approx(1e-3))] and timed.timed_kernels == 3
    assert "5 kernels (3 of them timed on this CPU at their own shapes)" in timed.line()
    busy = DeviceSpec(**{**device.__dict__, "kernel_seconds": lambda label, roofline: KernelTime(0.5, True)})
    line = predict_step_time(OpProfile(counts), busy).line()
    assert "(3 of them timed on this CPU at their own shapes; 3 on one thread, as other processes kept" in line


@pytest.fixture
def two_threads():
    """The suite's workers run one thread each (conftest); these tests need torch to have several."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(threads)


def _compute(seconds: float) -> None:
    """Busy on the calling thread for ``seconds``, as a kernel on one thread is."""
    until = time.perf_counter() + seconds
    while time.perf_counter() < until:
        pass


def test_a_kernel_whose_threads_wait_for_busy_cores_is_timed_on_one_thread(two_threads):
    def waits_when_split() -> None:  # as a split kernel waits out another process's scheduler slice
        time.sleep(0.004 if torch.get_num_threads() > 1 else 0.001)  # one thread loses a slice less often
        _compute(0.0005)

    busy = timed_on_free_cores(waits_when_split, repeats=3)
    assert busy.one_thread and 0.0004 <= busy.seconds < 0.001  # its own work (CPU time, a little under wall), no wait
    assert torch.get_num_threads() == 2  # the run's threads are given back

    idle = timed_on_free_cores(lambda: _compute(0.001), repeats=3)
    assert not idle.one_thread and idle.seconds >= 0.001  # torch's threads' own time, as the run will have it


def test_the_cpus_rates_say_when_they_were_measured_on_one_thread(monkeypatch):
    monkeypatch.setattr(
        devices, "timed_on_free_cores", lambda run, repeats=5: KernelTime(timed_on_free_cores(run, repeats)[0], True)
    )
    assert devices.local_cpu.__wrapped__().name.endswith("measured; its cores were busy: rates of one thread)")


def test_a_large_matmul_runs_with_shorter_sides_and_never_below_the_smallest():
    a, b = _TensorSpec(torch.bfloat16, (4096, 2048), (1, 4096)), _TensorSpec(torch.bfloat16, (2048, 1024), (1024, 1))
    (x, y), fraction = _smaller(torch.ops.aten.mm, [a, b], 4)
    assert (x.shape, x.strides, y.shape) == ((1024, 2048), (1, 1024), (2048, 1024)) and fraction == 0.25
    (x, y), fraction = _smaller(torch.ops.aten.mm, [a, b], 10**6)
    assert (x.shape[0], y.shape[1]) == (SMALLEST_SIDE, SMALLEST_SIDE) and fraction == SMALLEST_SIDE**2 / (4096 * 1024)
    bias = _TensorSpec(torch.float32, (1024,), (1,))
    (shrunk_bias, _, y), _ = _smaller(
        torch.ops.aten.addmm, [bias, _TensorSpec(torch.float32, (512, 2048), (2048, 1)), b], 4
    )
    assert shrunk_bias.shape == (256,) and y.shape == (2048, 256)  # the bias follows its side
    head = _TensorSpec(torch.bfloat16, (2, 2048, 32000), (0, 32000, 1))
    (_, shrunk_head), _ = _smaller(
        torch.ops.aten.bmm, [_TensorSpec(torch.bfloat16, (2, 256, 2048), (524288, 2048, 1)), head], 8
    )
    assert shrunk_head.shape == (2, 2048, 4000) and shrunk_head.strides == (0, 4000, 1)  # still broadcast
    narrow = [_TensorSpec(torch.bfloat16, (100, 8), (8, 1)), _TensorSpec(torch.bfloat16, (8, 9), (9, 1))]
    assert _smaller(torch.ops.aten.mm, narrow, 4)[1] is None  # nothing to cut


def test_attention_runs_with_fewer_rows_and_heads_keeping_its_query_heads_per_key_head():
    q = _TensorSpec(torch.bfloat16, (2, 8, 512, 64), (262144, 64, 512, 1))
    kv = _TensorSpec(torch.bfloat16, (2, 2, 512, 64), (65536, 64, 128, 1))
    logsumexp = _TensorSpec(torch.float32, (2, 8, 512), (4096, 512, 1))
    op = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward
    (shrunk_q, shrunk_kv, shrunk_lse, causal), fraction = _smaller(op, [q, kv, logsumexp, True], 4)
    assert (shrunk_q.shape, shrunk_kv.shape, shrunk_lse.shape, causal) == (
        (1, 4, 512, 64),
        (1, 1, 512, 64),
        (1, 4, 512),
        True,
    )
    assert fraction == 0.25 and shrunk_q.strides == (131072, 64, 256, 1)  # the layout in memory kept
    one_head = _TensorSpec(torch.bfloat16, (1, 1, 512, 64), (32768, 32768, 64, 1))
    assert _smaller(op, [one_head, one_head, one_head], 4)[1] is None


def test_the_roofline_serves_once_the_budget_is_spent_and_what_was_timed_stays(monkeypatch):
    label = "aten.mm.default float32[8,8](8,1) float32[8,8](8,1)"
    monkeypatch.setattr(kernel_replay, "_TIMES", {})
    monkeypatch.setattr(kernel_replay, "_spent", [0.0])
    first = kernel_seconds(label, 1e-6)
    assert first.seconds > 0
    assert kernel_seconds("aten.no_such_op.default float32[8](1)", 1e-6) is None
    assert kernel_seconds("aten.mm.default float32[8,8](8,1) float32[9,8](8,1)", 1e-6) is None  # shapes refused
    monkeypatch.setattr(kernel_replay, "_spent", [kernel_replay.REPLAY_BUDGET])
    assert kernel_seconds(label, 1e-6) == first  # reused: a step predicted twice is predicted the same
    assert kernel_seconds("aten.mm.default float32[4,8](8,1) float32[8,8](8,1)", 1e-6) is None  # nothing new


def test_forgotten_timings_are_timed_again_within_a_fresh_budget(monkeypatch):
    label = "aten.mm.default float32[8,8](8,1) float32[8,8](8,1)"
    monkeypatch.setattr(kernel_replay, "_TIMES", {("aten.mm.default float32[4,4](4,1) float32[4,4](4,1)", 1): None})
    monkeypatch.setattr(kernel_replay, "_spent", [kernel_replay.REPLAY_BUDGET])
    assert kernel_seconds(label, 1e-6) is None  # the budget is spent: the roofline serves
    kernel_replay.forget_timings()
    assert kernel_replay._TIMES == {}
    assert kernel_seconds(label, 1e-6).seconds > 0 and kernel_replay._spent[0] < kernel_replay.REPLAY_BUDGET


def test_every_matmul_and_attention_kernel_of_the_simulated_step_runs_again_on_this_cpu(monkeypatch):
    """The labels come from fake tensors: each must rebuild, or the CPU's prediction quietly falls back."""
    monkeypatch.setattr(kernel_replay, "_spent", [0.0])  # whatever this worker's earlier tests replayed
    ids = torch.zeros(2, 64, dtype=torch.long)
    estimate = estimate_memory(
        lambda: TinyLlama(hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4),
        {"input_ids": ids, "labels": ids},
        precision="bf16-mixed",
        lora={"r": 4, "target_modules": "all-linear"},
    )
    labelled = sum(n for (_, _, _, _, kind), n in estimate.ops.counts.items() if " " in kind)
    kinds = Counter(kind.split(" ")[0] for (_, _, _, _, kind) in estimate.ops.counts)
    assert kinds["matmul"] > 10 and kinds["attention"] == 2  # forward and backward of one shape
    step = predict_step_time(estimate.ops, local_cpu())
    assert step.timed_kernels == labelled > 0
