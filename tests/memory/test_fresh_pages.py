"""Fresh pages: a CPU step's new storages of 32 MiB or more are counted (``op_counts``), and the step-time
prediction charges the first write to them where no replay of the kernel already paid it (``step_time``)."""

from collections import Counter

import pytest
import torch

from pl_lowprec.memory.devices import DeviceSpec
from pl_lowprec.memory.kernel_replay import REPLAY_LIMIT, KernelTime
from pl_lowprec.memory.op_counts import FRESH_PAGES, KERNEL, CountingMode, OpProfile
from pl_lowprec.memory.step_time import predict_step_time

MiB = 2**20


def test_new_storages_of_32_mib_or_more_are_counted_once_per_kernel():
    big = torch.ones(FRESH_PAGES // 4 + 1024)  # just over 32 MiB of fp32
    small = torch.ones(1024)
    with CountingMode() as mode:
        doubled = big * 2  # a new 32 MiB storage
        small * 2  # a new storage below the threshold
        doubled.mul_(2)  # in place: writes pages it already holds
        doubled.view(-1, 1024)  # a view: no storage
        torch.empty(FRESH_PAGES // 4 + 1024).fill_(1)  # an allocation, then a write to the pages it holds
    profile = mode.counter.profile
    assert list(profile.fresh.values()) == [big.nbytes]
    (key,) = profile.fresh
    assert "aten.mul.Tensor" in key[4] and profile.counts[key] == 1
    assert profile.allocated_fresh == big.nbytes


def test_the_depth_line_keeps_each_kernels_fresh_bytes_and_extrapolates_the_allocations():
    key = ("", 0, 10, False, "kernel aten.mul")
    two = OpProfile(Counter({key: 2}), fresh={key: 40 * MiB}, allocated_fresh=100 * MiB)
    three = OpProfile(Counter({key: 3}), fresh={key: 40 * MiB}, allocated_fresh=150 * MiB)
    line = OpProfile.line(two, three, 10 - 2)  # 8 blocks past the 2nd: the profile at 10
    assert line.counts[key] == 10 and line.fresh == {key: 40 * MiB}
    assert line.allocated_fresh == 500 * MiB


def _profile(fresh: int) -> OpProfile:
    key = ("", 0, 10**9, False, f"{KERNEL} aten.mul.Tensor float32[1](1,)")
    return OpProfile(Counter({key: 3}), fresh={key: fresh}, allocated_fresh=fresh)


@pytest.mark.parametrize(
    ("bandwidth", "replayed", "charged"),
    [
        (1e12, None, 4),  # not replayed: the roofline misses the pages of all 3 calls and the allocation
        (1e12, 0.5, 1),  # replayed whole (1 ms roofline): its own pages are in its time; the allocation's are not
        (1e9, 0.5, 4),  # replayed smaller and scaled (1 s roofline): no fresh pages in the replay
    ],
)
def test_a_cpu_charges_fresh_pages_where_no_replay_paid_them(bandwidth, replayed, charged):
    timer = None if replayed is None else (lambda label, roofline: KernelTime(replayed))
    cpu = DeviceSpec("cpu", {"fp32": 1e12}, bandwidth, launch_overhead=0.0, asynchronous=False, kernel_seconds=timer)
    per_byte = 1e-10
    if replayed is not None:
        assert (1e9 / (bandwidth * cpu.memory_efficiency) <= REPLAY_LIMIT) == (charged == 1)
    step = predict_step_time(_profile(64 * MiB), DeviceSpec(**{**cpu.__dict__, "fresh_page_seconds": per_byte}))
    without = predict_step_time(_profile(64 * MiB), cpu)
    assert step.fresh_bytes == charged * 64 * MiB
    assert step.fresh_pages == pytest.approx(charged * 64 * MiB * per_byte)
    assert step.seconds == pytest.approx(without.seconds + step.fresh_pages)
    assert without.fresh_pages == 0 and "fresh pages" not in without.line()
    assert f"fresh pages {step.fresh_pages:.3f} s" in step.line()
    assert f"{step.fresh_bytes / 1e6:,.2f} MB of them to fresh pages, whose first write the OS waits on" in step.line()


def test_the_line_names_the_settings_that_keep_freed_blocks_only_where_fresh_pages_weigh():
    cpu = DeviceSpec("cpu", {"fp32": 1e12}, 1e12, launch_overhead=0.0, asynchronous=False)
    settings = "MALLOC_MMAP_MAX_=0 MALLOC_TRIM_THRESHOLD_=68719476736"
    for per_byte, named in ((1e-10, True), (1e-14, False)):
        step = predict_step_time(_profile(64 * MiB), DeviceSpec(**{**cpu.__dict__, "fresh_page_seconds": per_byte}))
        assert (step.fresh_pages >= 0.1 * step.seconds) == named
        assert (f"start Python with {settings} to keep freed blocks for reuse" in step.line()) == named
