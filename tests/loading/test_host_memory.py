"""After the streaming load, the heap blocks it freed go back to the system (glibc's malloc_trim)."""

import sys

import pytest
import torch
from loading_helpers import save_llama
from qlora_helpers import tiny_llama

from pl_lowprec import LowPrecisionStrategy
from pl_lowprec.loading import empty_weights
from pl_lowprec.loading.host_memory import release_freed_host_memory
from pl_lowprec.transforms import pipeline

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc_trim")


def _resident_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * 4096


@linux_only
def test_freed_heap_blocks_return_to_the_system():
    release_freed_host_memory()  # what earlier tests freed would otherwise take some of the blocks below
    base = _resident_bytes()
    blocks = [torch.ones(2048) for _ in range(20_000)]  # 160 MiB in 8 KiB tensors: glibc's heap, not mmap
    pinned = blocks[::16]  # 10 MiB stay alive between the freed blocks, as a load's kept tensors do: the free
    del blocks  # space is then not at the heap's top, which glibc would give back by itself (a flaky precondition)
    kept = _resident_bytes() - base
    assert release_freed_host_memory()
    assert kept > 80 * 2**20  # glibc kept most of what was freed...
    assert _resident_bytes() - base < kept / 4  # ...until trimmed
    del pinned


def test_called_once_after_a_pretrained_load_only(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(pipeline, "release_freed_host_memory", lambda: calls.append(1))
    directory = save_llama(tmp_path / "ckpt")
    with empty_weights():
        model = tiny_llama()
    transform = LowPrecisionStrategy(pretrained=directory, pretrained_prefix="model.").transform
    transform.load_pretrained(model, torch.float32, torch.device("cpu"))
    assert calls == [1] and not any(p.is_meta for p in model.parameters())
    LowPrecisionStrategy().transform.load_pretrained(tiny_llama(), torch.float32, torch.device("cpu"))
    assert calls == [1]  # nothing was loaded, nothing to give back
