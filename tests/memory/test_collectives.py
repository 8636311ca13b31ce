"""The collectives of a step across ranks: FSDP2's as the fake step runs them, DDP's gradient all-reduce in its
buckets, their time on a ring, and how a step adds them: on a CPU in full, on a GPU beside the kernels."""

import dataclasses
import functools
from collections import Counter

import pytest
import torch

from pl_lowprec import estimate_memory
from pl_lowprec.demo import TinyLlama
from pl_lowprec.memory.collectives import (
    ALL_GATHER,
    ALL_REDUCE,
    REDUCE_SCATTER,
    Interconnect,
    ddp_buckets,
    measure_interconnect,
    wire_bytes,
)
from pl_lowprec.memory.devices import GPUS, DeviceSpec
from pl_lowprec.memory.op_counts import OpProfile
from pl_lowprec.memory.step_time import predict_step_time

MiB = 2**20
LORA = {"r": 4}


def _tiny_llama_estimate(**settings):
    build = functools.partial(TinyLlama, hidden_size=64, intermediate_size=128, num_layers=2, max_len=64)
    return estimate_memory(build, {"input_ids": torch.zeros(2, 64, dtype=torch.long)}, quantization="nf4", **settings)


def test_a_sharded_step_counts_each_units_all_gather_and_its_gradients_reduce_scatter():
    pytest.importorskip("torchao")
    from pl_lowprec.distributed.sharding import Sharding
    from pl_lowprec.transforms.nf4 import NF4Layout

    sharding = Sharding(units=["LlamaDecoderLayer"], layout=NF4Layout(scaler_block_size=32))
    estimate = _tiny_llama_estimate(lora=LORA, sharding=sharding, world_size=2, extrapolate=False)
    found = estimate.ops.collectives
    assert estimate.ops.ranks == 2
    gathers = Counter({size: n for (kind, size), n in found.items() if kind == ALL_GATHER})
    scatters = Counter({size: n for (kind, size), n in found.items() if kind == REDUCE_SCATTER})
    assert {kind for kind, _ in found} == {ALL_GATHER, REDUCE_SCATTER}
    # each block gathered for its forward and again for its backward (resharded after forward); the root once
    assert sorted(gathers.values()) == [1, 4]
    # one reduce-scatter per block: every rank's shard of the adapters' fp32 gradients, summed = all of them
    assert sum(scatters.values()) == 2
    assert sum(size * n for size, n in scatters.items()) == 2 * estimate.gradients


def test_ddp_adds_its_gradient_all_reduce_and_one_process_has_none():
    one = _tiny_llama_estimate(lora=LORA)
    two = _tiny_llama_estimate(lora=LORA, world_size=2)
    assert not one.ops.collectives and one.ops.ranks == 1
    assert two.ops.collectives == Counter({(ALL_REDUCE, one.gradients): 1}) and two.ops.ranks == 2
    assert two.peak == one.peak + one.gradients and two.world_size == 2  # per rank: DDP's buckets added
    assert ddp_buckets(60 * MiB) == [MiB, 25 * MiB, 25 * MiB, 9 * MiB]  # DDP's first bucket, then 25 MiB ones
    assert ddp_buckets(MiB // 2) == [MiB // 2] and ddp_buckets(0) == []


def test_a_collective_moves_its_ring_share_after_its_latency():
    link = Interconnect("link", dict.fromkeys((ALL_GATHER, REDUCE_SCATTER, ALL_REDUCE), 1e9), latency=1e-5)
    assert wire_bytes(ALL_GATHER, 8_000_000, 4) == 6_000_000  # 3/4 of the whole tensor passes each link
    assert wire_bytes(ALL_REDUCE, 8_000_000, 4) == 12_000_000  # a reduce-scatter, then an all-gather
    assert link.seconds(ALL_GATHER, 8_000_000, 4) == pytest.approx(1e-5 + 6e-3)
    assert link.seconds(ALL_REDUCE, 8_000_000, 4) == pytest.approx(1e-5 + 12e-3)
    assert link.seconds(ALL_REDUCE, 8_000_000, 1) == 0.0


def _step() -> OpProfile:
    """One kernel of 1 s (1 TFLOP at 1 TFLOP/s, ``_device``), 10 all-gathers and 10 reduce-scatters of 8 MB on 2
    ranks."""
    profile = OpProfile(ranks=2)
    profile.counts[("fp32", 10**12, 8, False, "")] = 1
    profile.collectives[(ALL_GATHER, 8_000_000)] = 10
    profile.collectives[(REDUCE_SCATTER, 8_000_000)] = 10
    return profile


def _device(asynchronous: bool, collective_seconds: float) -> DeviceSpec:
    """A device of 1 TFLOP/s whose link runs each of ``_step``'s collectives in ``collective_seconds``."""
    rate = 4_000_000 / collective_seconds  # half of 8 MB crosses each link on 2 ranks
    link = Interconnect("a link", dict.fromkeys((ALL_GATHER, REDUCE_SCATTER, ALL_REDUCE), rate), latency=0.0)
    return DeviceSpec("dev", {"fp32": 1e12}, 1e15, 0.0, 1.0, 1.0, asynchronous, interconnect=link)


@pytest.mark.parametrize(
    ("asynchronous", "each", "expected"),
    [
        (False, 0.05, 1.0 + 1.0),  # a CPU: gloo waits on the cores, every collective adds
        (True, 0.05, 1.0 + 0.1),  # a GPU: 1 s of collectives beside 1 s of kernels; the first and last exposed
        (True, 0.15, 1.0 + 2.0 + 0.3),  # 3 s of collectives outlast the kernels by 2 s
        (True, 0.01, 1.0 + 0.02),  # hidden but for one all-gather and one reduce-scatter
    ],
    ids=["cpu", "gpu-even", "gpu-outlasting", "gpu-hidden"],
)
def test_a_cpu_adds_the_collectives_and_a_gpu_runs_them_beside_the_kernels(asynchronous, each, expected):
    step = predict_step_time(_step(), _device(asynchronous, each))
    assert step.seconds == pytest.approx(expected)
    assert step.collective_seconds == pytest.approx(20 * each) and step.collectives == 20
    assert step.communication == pytest.approx(expected - 1.0)
    assert step.wire_bytes == 20 * 4_000_000
    assert f"communication {step.communication:.3f} s" in step.line() and "on a link" in step.line()


def test_on_a_gpu_the_largest_all_gather_waits_before_any_kernel():
    profile = _step()
    profile.collectives[(ALL_GATHER, 80_000_000)] = 1  # FSDP2's root: the embeddings, gathered first
    step = predict_step_time(profile, _device(True, 0.01))
    # 0.2 s of collectives and the root's 0.1 s, beside 1 s of kernels: the root and one reduce-scatter exposed
    assert step.collective_seconds == pytest.approx(0.3)
    assert step.seconds == pytest.approx(1.0 + 0.1 + 0.01)


def test_a_measured_interconnect_replaces_the_devices_and_none_leaves_them_untimed():
    profile = _step()
    untimed = dataclasses.replace(_device(False, 0.05), interconnect=None)
    step = predict_step_time(profile, untimed)
    assert step.seconds == pytest.approx(1.0) and step.communication == 0 and step.interconnect == ""
    assert step.line().endswith(
        "; 20 collectives, 80.00 MB through each rank's link, not timed: no figures for how this device's ranks"
        " talk (a run measures its own process group)"
    )
    measured = Interconnect("gloo between 2 ranks", _device(False, 0.1).interconnect.bus_bandwidth, 0.0, True)
    step = predict_step_time(profile, untimed, measured)
    assert step.seconds == pytest.approx(1.0 + 2.0) and step.interconnect == "gloo between 2 ranks, measured"


def test_named_gpus_carry_their_links():
    assert GPUS["H100"].interconnect.name == GPUS["H200"].interconnect.name == "NVLink (Hopper)"
    nvlink, pcie = GPUS["H100"].interconnect, GPUS["RTX4090"].interconnect
    assert nvlink.seconds(ALL_GATHER, 2**30, 2) < pcie.seconds(ALL_GATHER, 2**30, 2) / 10
    assert GPUS["T4"].interconnect.bus_bandwidth[ALL_REDUCE] == pcie.bus_bandwidth[ALL_REDUCE] / 2
    estimate = _tiny_llama_estimate(lora=LORA, world_size=2)
    line = estimate.step_time_on("L4").line()
    assert "; 1 collective, " in line and "on PCIe 4.0" in line


@pytest.mark.parametrize(
    ("backend", "device"),
    [("gloo", "cpu"), pytest.param("nccl", "cuda", marks=pytest.mark.cuda)],
)
def test_the_measurement_runs_on_the_process_groups_device(tmp_path, backend, device):
    """One rank: its tensors, synchronization and the MAX reduction on the group's own device (NCCL takes no CPU
    tensors); the 2-rank figures come from tests/strategies/test_ddp.py's gloo run."""
    import torch.distributed as dist

    dist.init_process_group(backend, init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        link = measure_interconnect(torch.device(device, 0) if device == "cuda" else torch.device(device))
    finally:
        dist.destroy_process_group()
    assert link.name == f"{backend} between 1 rank" and link.measured
    assert 0 <= link.latency < 0.1 and set(link.bus_bandwidth) == {ALL_GATHER, REDUCE_SCATTER, ALL_REDUCE}
    assert link.seconds(ALL_REDUCE, 2**30, 1) == 0.0  # one rank sends nothing
