"""The step-time prediction: what the op counter counts (FLOPs by formula, bytes read and written, no views), the
device table, the roofline per kernel, its scaling, extrapolation with the blocks, and estimate/plan using it."""

import functools
from collections import Counter
from pathlib import Path

import pytest
import torch
from gguf_helpers import fail_if_called
from torch import nn

from pl_lowprec import estimate_memory
from pl_lowprec.cli.dispatch import main as pl_lowprec_cli
from pl_lowprec.cli.estimate import main as estimate_cli
from pl_lowprec.demo import TinyLlama
from pl_lowprec.memory.devices import GPUS, DeviceSpec, device_spec, local_cpu
from pl_lowprec.memory.estimate import resolved_precision
from pl_lowprec.memory.fastest import MemorySettings
from pl_lowprec.memory.op_counts import ATTENTION, MATMUL, CountingMode, OpProfile, family
from pl_lowprec.memory.plan import Settings, plan_memory, resized
from pl_lowprec.memory.step_time import predict_step_time
from pl_lowprec.transforms.config import TransformConfig

ROOT = Path(__file__).resolve().parents[2]


def _counted(run):
    mode = CountingMode()
    with mode:
        run()
    return mode.counter.profile


class Linear(nn.Module):
    def __init__(self, k: int, n: int) -> None:
        super().__init__()
        self.linear = nn.Linear(k, n, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x)


def test_a_linear_training_step_counts_its_two_matmuls_by_the_formula():
    rows, k, n = 64, 32, 48
    estimate = estimate_memory(lambda: Linear(k, n), torch.zeros(rows, k), time_on="H100")
    # forward x @ W.T and the weight's gradient grad.T @ x: 2 * rows * k * n each (the input needs no gradient)
    assert estimate.ops.flops == 2 * (2 * rows * k * n)
    plain = estimate_memory(lambda: Linear(k, n), torch.zeros(rows, k))
    assert plain.as_dict() == estimate.as_dict() and plain.timeline == estimate.timeline  # memory unchanged


def test_a_matmul_counts_flops_and_bytes_on_real_tensors():
    a, b = torch.randn(8, 16), torch.randn(16, 4)
    profile = _counted(lambda: a @ b)
    assert profile.launches == 1
    assert profile.flops == 2 * 8 * 16 * 4
    assert profile.bytes == (8 * 16 + 16 * 4 + 8 * 4) * 4  # both inputs read, the output written


def test_elementwise_bytes_are_inputs_read_and_outputs_written():
    a, b = torch.randn(1000), torch.randn(1000)
    assert _counted(lambda: a + b).bytes == 3 * 4000
    assert _counted(lambda: a.add_(b)).bytes == 3 * 4000  # read a and b, write a
    assert _counted(lambda: a.copy_(b)).bytes == 2 * 4000  # the destination is written, not read
    assert _counted(lambda: a + b[:1].expand(1000)).bytes == 4000 + 4 + 4000  # a broadcast element is read once
    half = _counted(lambda: a.to(torch.bfloat16))
    assert (half.bytes, half.flops) == (4000 + 2000, 0)


def test_view_ops_launch_nothing():
    a = torch.randn(4, 6, requires_grad=True)
    profile = _counted(lambda: (a.view(6, 4), a.t(), a[1:], a.detach(), a.reshape(24), a.transpose(0, 1), a.unbind()))
    assert profile.launches == profile.bytes == 0


def test_an_embedding_reads_the_rows_it_returns_not_the_table():
    table, ids = torch.randn(50_000, 8), torch.tensor([[1, 2, 3]])
    assert _counted(lambda: nn.functional.embedding(ids, table)).bytes == 3 * 8 + 2 * (3 * 8 * 4)


def test_the_device_table_and_the_refusal_of_an_unknown_gpu():
    assert device_spec("H100").flops["bf16"] == 989.4e12
    assert device_spec("h200").bandwidth == 4.8e12
    assert device_spec("RTX 4090") is device_spec("4090") is GPUS["RTX4090"]
    assert device_spec("NVIDIA A100") is GPUS["A100"]
    assert "bf16" not in device_spec("T4").flops
    with pytest.raises(ValueError) as error:
        device_spec("V100")
    message = str(error.value)
    assert "'V100'" in message and all(name in message for name in GPUS) and "cpu" in message
    assert "\n" not in message  # one paragraph


def test_bf16_on_a_t4_is_refused_before_the_simulation():
    def never_built():
        raise AssertionError("the model was built: the refusal came too late")

    with pytest.raises(ValueError, match=r"T4 .*no bf16.*16-mixed"):
        estimate_memory(never_built, torch.zeros(2, 4), precision="bf16-mixed", time_on="T4")


def test_each_kernel_takes_the_longest_of_its_flops_bytes_and_launch():
    device = DeviceSpec("test", {"bf16": 100e12}, bandwidth=1e12, launch_overhead=1e-5)
    device = DeviceSpec(**{**device.__dict__, "matmul_efficiency": 0.5, "memory_efficiency": 0.5})
    profile = OpProfile(
        Counter(
            {
                ("bf16", 10**12, 10**6, False, ""): 1,  # 1e12 / 50e12 = 20 ms of FLOPs
                ("", 0, 10**9, False, ""): 1,  # 1e9 / 0.5e12 = 2 ms of bytes
                ("", 0, 1000, False, ""): 10,  # tiny: the GPU waits 10 us for each launch
                ("", 0, 1000, True, ""): 10,  # the optimizer step's kernels: foreach, no launch each
            }
        )
    )
    step = predict_step_time(profile, device)
    assert step.compute_bound == pytest.approx(0.02)
    assert step.memory_bound == pytest.approx(0.002 + 10 * 1000 / 0.5e12)
    assert step.launch_overhead == pytest.approx(10 * 1e-5)
    assert step.seconds == pytest.approx(step.compute_bound + step.memory_bound + step.launch_overhead)
    assert step.launches == 22
    on_cpu = predict_step_time(profile, DeviceSpec(**{**device.__dict__, "asynchronous": False}))
    assert on_cpu.launch_overhead == pytest.approx(22 * 1e-5)  # the CPU dispatches, then computes: they add


def test_a_compiled_step_waits_for_no_launch_on_a_gpu_and_still_dispatches_on_a_cpu():
    """Compiled graphs launch their kernels without Python between them: on a GPU none waits for the host."""
    device = DeviceSpec("test", {"bf16": 100e12}, bandwidth=1e12, launch_overhead=1e-5)
    counts = Counter({("bf16", 10**12, 10**6, False, ""): 1, ("", 0, 1000, False, ""): 10, ("", 0, 1000, True, ""): 10})
    eager, compiled = OpProfile(counts), OpProfile(counts, compiled=True)
    assert predict_step_time(eager, device).launch_overhead == pytest.approx(10 * 1e-5)
    step = predict_step_time(compiled, device)
    assert step.launch_overhead == 0 and step.memory_bound == pytest.approx(20 * 1000 / (0.8 * 1e12))
    cpu = DeviceSpec(**{**device.__dict__, "asynchronous": False})
    assert predict_step_time(compiled, cpu).launch_overhead == predict_step_time(eager, cpu).launch_overhead


def test_fused_attention_is_counted_apart_from_the_matmuls_around_it():
    q, k, v = (torch.randn(1, 2, 16, 8, requires_grad=True) for _ in range(3))
    w = torch.randn(8, 8)

    def attention_then_matmul():
        out = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        (out @ w).sum().backward()

    kinds = Counter()
    for (_, flops, _, _, kind), n in _counted(attention_then_matmul).counts.items():
        kinds[family(kind)] += flops * n
    forward = 4 * 2 * 16 * 16 * 8 // 2  # 2 heads, 16 positions, head size 8, causal: half the square
    assert kinds[ATTENTION] == forward + 5 * forward // 2  # the backward: 2.5 times the forward
    assert kinds[MATMUL] == 2 * (2 * 2 * 16 * 8 * 8)  # out @ w and the gradient of out (w needs none)


def test_on_a_cpu_attention_runs_at_its_measured_rate_and_each_matmul_pays_its_latency():
    counts = Counter({("bf16", 10**9, 10**3, False, ATTENTION): 1, ("bf16", 10**9, 10**3, False, ""): 4})
    gpu = DeviceSpec("gpu", {"bf16": 1e12}, bandwidth=1e12, launch_overhead=0.0, matmul_efficiency=1.0)
    assert predict_step_time(OpProfile(counts), gpu).compute_bound == pytest.approx(5e-3)  # all at the matmul rate
    cpu = DeviceSpec(
        **{**gpu.__dict__, "asynchronous": False, "attention_flops": {"bf16": 1e11}, "matmul_latency": {"bf16": 1e-5}}
    )
    step = predict_step_time(OpProfile(counts), cpu)
    assert step.compute_bound == pytest.approx(1e-2 + 4 * (1e-3 + 1e-5))


def test_the_local_cpu_measures_attention_and_matmul_latency_per_dtype():
    cpu = local_cpu()
    assert set(cpu.attention_flops) == {"fp32", "bf16"} and min(cpu.attention_flops.values()) > 0
    assert set(cpu.matmul_latency) == {"fp32", "bf16", "fp16"} and min(cpu.matmul_latency.values()) >= 0
    assert cpu.attention_flops_per_second("fp16") == cpu.flops_per_second("fp16")  # not measured: the matmul rate
    assert not any(gpu.attention_flops or gpu.matmul_latency for gpu in GPUS.values())  # spec sheets only


def test_the_host_proxy_launches_the_kernels_of_the_1b_step(tmp_path):
    """gpu_peers.py --models host (benchmarks/model_shapes.py; docs/benchmarks.md, the host's share of a step):
    Llama-3.2-1B's blocks at tiny widths run the same kernels as the real shapes, so its CPU step time is the
    host's share of theirs."""
    import importlib.util
    import json

    from pl_lowprec.models import CausalLM

    # by path: tests/model_shapes.py is a module of the same name
    spec = importlib.util.spec_from_file_location("benchmark_model_shapes", ROOT / "benchmarks" / "model_shapes.py")
    shapes = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(shapes)
    ids = torch.zeros(2, 128, dtype=torch.long)
    lora = {"r": 16, "lora_alpha": 32, "lora_dropout": 0.0, "target_modules": "all-linear"}
    launches = {}
    for name, config in (("host", shapes.SMALL_SHAPES["host"]), ("1b", shapes.SHAPES["1b"])):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps(config))
        estimate = estimate_memory(
            lambda name=name: CausalLM(str(tmp_path / name), dtype="bfloat16"),
            {"input_ids": ids, "labels": ids},
            precision="bf16-mixed",
            quantization="nf4-dq",
            lora=lora,
            memory_saving=False,  # the path auto chooses where memory is free, as on the H200
            extrapolate=False,  # both simulated block by block: the host's peak moves with depth, the 1b's not
        )
        launches[name] = estimate.ops.launches
    assert launches["host"] == launches["1b"] > 5000, launches  # 5,730 on 2026-11-29


@pytest.mark.parametrize(
    ("model", "gpu", "measured_step_s", "measured_peak_gib"),
    [("1b", "H100", 0.125, 2.22), ("1b", "H200", 0.121, 2.22), ("8b", "H200", 0.418, 8.32)],
)
def test_the_compiled_memory_saving_step_is_predicted_near_the_gpu_measurements(
    tmp_path, model, gpu, measured_step_s, measured_peak_gib
):
    """docs/benchmarks.md, gpu_peers run 3 (an H100) and run 5 (an H200), torch 2.11: the memory-saving path with
    compile= at Llama shapes, batch 2 x 2048; timed as eager kernels, run 3's 1B step was predicted at 0.295 s."""
    import importlib.util
    import json

    from pl_lowprec import LowPrecisionStrategy
    from pl_lowprec.models import CausalLM

    # the benchmark's own copy of the shapes (tests/model_shapes.py, a module of the same name, lacks this model)
    spec = importlib.util.spec_from_file_location("benchmark_model_shapes", ROOT / "benchmarks" / "model_shapes.py")
    shapes = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(shapes)
    (tmp_path / "config.json").write_text(json.dumps(shapes.SHAPES[model]))
    ids = torch.zeros(2, 2048, dtype=torch.long)
    lora = {"r": 16, "lora_alpha": 32, "lora_dropout": 0.0, "target_modules": "all-linear"}
    strategy = LowPrecisionStrategy(
        quantization="nf4-dq", lora=lora, activation_checkpointing="LlamaDecoderLayer", compile=True
    )
    estimate = estimate_memory(
        lambda: CausalLM(str(tmp_path), loss_chunk_size=256, dtype="bfloat16"),
        {"input_ids": ids, "labels": ids},
        precision="bf16-mixed",
        device=torch.device("cuda"),
        config=strategy.transform_config,
        time_on=gpu,
    )
    assert estimate.ops.compiled
    assert abs(estimate.step_time.seconds / measured_step_s - 1) < 0.25, estimate.step_time.line()
    assert estimate.peak / 2**30 == pytest.approx(measured_peak_gib, rel=0.05)  # max_memory_allocated, same run


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(1024, 4096), nn.Linear(4096, 1024)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(x)))


def test_twice_the_tokens_take_twice_the_compute_bound_time():
    one, two = (
        estimate_memory(MLP, torch.zeros(rows, 1024), time_on="H100").step_time  # fp32: compute-bound
        for rows in (2048, 4096)
    )
    assert two.flops / one.flops == pytest.approx(2.0, rel=0.01)
    assert two.compute_bound / one.compute_bound == pytest.approx(2.0, rel=0.02)
    assert two.launches == one.launches


def test_extrapolated_blocks_count_the_kernels_of_every_block():
    build = functools.partial(TinyLlama, hidden_size=32, intermediate_size=64, num_layers=6, num_heads=4, max_len=16)
    # 8 rows: the peak stays in the backward at 2, 3 and 4 blocks (with 2, the forward, which holds the last
    # step's gradients, overtook it at 4 blocks, and every block was simulated)
    batch = {"input_ids": torch.zeros(8, 16, dtype=torch.long)}
    fast = estimate_memory(build, batch, lora={"r": 4}, activation_checkpointing=["LlamaDecoderLayer"])
    full = estimate_memory(
        build, batch, lora={"r": 4}, activation_checkpointing=["LlamaDecoderLayer"], extrapolate=False
    )
    assert fast.extrapolated and not full.extrapolated
    assert fast.ops.counts == full.ops.counts


def test_a_4bit_layer_counts_its_dequantized_weight_and_its_matmul():
    pytest.importorskip("bitsandbytes")
    rows, k, n = 16, 128, 256
    quantized = estimate_memory(
        lambda: Linear(k, n), torch.zeros(rows, k), precision="bf16-true", quantization="nf4", lora={"r": 4}
    )
    plain = estimate_memory(lambda: Linear(k, n), torch.zeros(rows, k), precision="bf16-true", lora={"r": 4})
    assert quantized.ops.flops == plain.ops.flops  # the base matmul and LoRA's, dequantized or not
    assert quantized.ops.bytes >= plain.ops.bytes + k * n * 2  # the bf16 weight the dequantize writes, at least


def test_estimate_prints_the_step_time_line(capsys):
    estimate_cli(["--config", str(ROOT / "configs/quickstart.yaml"), "--gpu", "h100"])
    lines = capsys.readouterr().out.splitlines()
    assert any(line.startswith("Predicted step time on H100 (SXM, 80 GB): ") for line in lines), lines[-3:]
    assert "Precision: bf16-mixed, as AMPPrecision('auto') chooses it on the h100." in lines


def test_estimate_on_a_named_gpu_is_the_run_on_that_gpu(capsys):
    """``precision: auto`` is chosen as on the GPU named, not on this machine: fp16 with loss scaling on a T4,
    which computes no bf16 (it was resolved on this CPU, bf16 here, and the T4 then refused it); the memory is
    CUDA's, not this CPU's."""
    estimate_cli(["--config", str(ROOT / "configs/quickstart.yaml"), "--gpu", "T4"])
    out = capsys.readouterr().out
    assert "Precision: 16-mixed, as AMPPrecision('auto') chooses it on the T4." in out
    assert "(cuda; estimated in " in out and "CUDA allocations rounded to 512 B" in out
    assert "Predicted step time on T4 (16 GB): " in out
    assert resolved_precision("auto", "cpu", "A100") == "bf16-mixed"
    assert resolved_precision("32-true", "cpu", "T4") == "32-true"  # only auto is chosen


def test_estimate_refuses_an_unknown_gpu_in_one_paragraph_before_estimating(capsys, monkeypatch):
    fail_if_called(monkeypatch, ["pl_lowprec.cli.estimate.estimate_arguments"], "the estimate ran")
    with pytest.raises(SystemExit) as exit_:
        pl_lowprec_cli(["estimate", "--config", str(ROOT / "configs/quickstart.yaml"), "--gpu", "V100"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("pl-lowprec estimate: error: No figures for a GPU named 'V100'"), err
    assert "H100" in err and "Traceback" not in err


def _tiny():
    return TinyLlama(hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, max_len=64)


def test_plan_ranks_by_predicted_time_where_flops_disagree():
    """On a fast GPU a tiny model waits on launches: one micro-batch of 4 with every 2nd block recomputed beats
    two of 2 without recompute, which relative FLOPs (no recompute = cheapest) ranked first."""
    batch = {"input_ids": torch.randint(0, 256, (4, 64))}
    config, blocks, cache = TransformConfig(lora={"r": 8}), ["LlamaDecoderLayer"], {}

    def plan(budget, micro_batch=None):
        make = functools.partial(resized, batch)
        return plan_memory(
            _tiny, make, budget, 4, config=config, margin=0.0, block_names=blocks, cache=cache, time_on="H100",
            micro_batch=micro_batch,
        )  # fmt: skip

    # every candidate of micro-batch 4 (nothing fits), and the first of 2 (all fits): the three compared below,
    # simulated once for both plans (the cache); the rest as the plan at the budget walks them
    everything = {c.settings: c for budget, micro in ((0, 4), (2**62, 2)) for c in plan(budget, micro).candidates}
    none, every_2nd = MemorySettings("none", frozenset()), MemorySettings("every 2nd block", frozenset())
    every_2nd, smaller = Settings(4, 1, every_2nd), Settings(2, 2, none)
    budget = everything[every_2nd].peak  # fits it and every smaller peak, not micro-batch 4 without recompute
    assert max(everything[every_2nd].peak, everything[smaller].peak) <= budget < everything[Settings(4, 1, none)].peak
    planned = plan(budget)
    fitting = [c for c in planned.candidates if c.fits]
    assert [c.step.seconds for c in fitting] == sorted(c.step.seconds for c in fitting)
    assert planned.chosen.settings == every_2nd
    assert planned.chosen.step.seconds < everything[smaller].step.seconds
    assert "Ranked by the predicted optimizer step on H100 (SXM, 80 GB)" in planned.table()


def test_grouped_query_attention_counts_full_attention_on_a_torch_whose_formula_refuses_it(monkeypatch):
    """torch 2.11's SDPA flop formula asserts on fewer key/value heads than queries (the H200 run's estimate
    failed there); the count is then that of the heads repeated, as torch 2.13 counts it."""
    from torch.utils import flop_counter

    from pl_lowprec.memory.op_counts import _flops

    q, k, v = torch.empty(2, 8, 64, 32), torch.empty(2, 2, 64, 32), torch.empty(2, 2, 64, 32)
    op = torch.ops.aten._scaled_dot_product_efficient_attention.default
    native, dtype = _flops(op, (q, k, v, None, False), {}, None)
    assert native == 2 * (2 * 2 * 8 * 64 * 64 * 32) and dtype == "fp32"
    counted = flop_counter.sdpa_flop_count

    def without_gqa(query_shape, key_shape, value_shape):
        if query_shape[1] != key_shape[1]:
            raise AssertionError("sdpa_flop_count: query/key/value shapes are incompatible")
        return counted(query_shape, key_shape, value_shape)

    monkeypatch.setattr(flop_counter, "sdpa_flop_count", without_gqa)
    assert _flops(op, (q, k, v, None, False), {}, None) == (native, "fp32")


def test_measuring_the_local_cpu_leaves_the_random_state_alone():
    """It runs inside the first fit's estimate (the automatic choice, memory_budget=): a draw from the global
    generator there gave the first fit of a process other numbers than a later one (the resume tests found it)."""
    from pl_lowprec.memory.devices import local_cpu

    local_cpu.cache_clear()
    before = torch.random.get_rng_state()
    local_cpu()
    assert torch.equal(torch.random.get_rng_state(), before)


@pytest.mark.parametrize(
    ("threads", "named"), [(1, "this CPU (1 thread, measured)"), (2, "this CPU (2 threads, measured)")]
)
def test_the_local_cpu_is_named_with_its_threads(monkeypatch, threads, named):
    """The name is what the step-time lines print ("predicted ... on this CPU (2 threads, measured)")."""
    from pl_lowprec.memory import devices
    from pl_lowprec.memory.devices import local_cpu
    from pl_lowprec.memory.kernel_replay import KernelTime, best_seconds

    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    # torch's threads stay as they are: timing on one thread too would set them to the count pretended here
    monkeypatch.setattr(devices, "timed_on_free_cores", lambda run, repeats=5: KernelTime(best_seconds(run, repeats)))
    local_cpu.cache_clear()
    try:
        assert local_cpu().name == named
    finally:
        local_cpu.cache_clear()  # the next caller measures with the real thread count
