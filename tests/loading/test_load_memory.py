"""Streaming a checkpoint into a meta-device model keeps peak host memory near the quantized model's size."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import warm_python

SCRIPT = Path(__file__).parents[1] / "_scripts" / "load_memory.py"

pytest.importorskip("bitsandbytes")
pytest.importorskip("transformers")


def _run(mode: str, directory: Path) -> dict:
    """A measurement in a fresh interpreter (resident memory is its subject); writing the checkpoint measures
    nothing, so it runs in a warm child (tests/warm_python.py): one import of torch and transformers less."""
    command = [sys.executable, str(SCRIPT), mode, str(directory)]
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "1048576"}  # see load_memory.py
    if mode == "write":
        result = warm_python.run(command, timeout=300, env=env)
    else:
        result = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1]) if mode != "write" else {}


@pytest.fixture(scope="module")
def written(tmp_path_factory) -> Path:
    """The 200+ MiB checkpoint, written once for both tests (in a warm child: it measures nothing)."""
    directory = tmp_path_factory.mktemp("st")
    _run("write", directory)
    return directory


@pytest.fixture(scope="module")
def streamed(written) -> dict:
    """Its nf4-dq streamed load from safetensors, measured once for both tests."""
    return _run("stream", written)


@pytest.mark.slow
def test_streamed_load_peaks_well_under_the_full_precision_model(written, streamed):
    full = _run("full", written)
    size = streamed["fp32_model_bytes"]
    assert size > 200 * 2**20
    # Streamed: the quantized model (0.14x) plus one tensor and its quantization temporaries, well under the fp32 model.
    assert streamed["added_peak_bytes"] < 0.35 * size, streamed
    # The same measurement sees the whole model when it is loaded before quantizing: it can tell them apart.
    assert full["added_peak_bytes"] > 0.9 * size, full
    print(
        f"\nfp32 model {size / 2**20:.0f} MiB; peak added by loading:"
        f" streamed {streamed['added_peak_bytes'] / 2**20:.0f} MiB,"
        f" full load then quantize {full['added_peak_bytes'] / 2**20:.0f} MiB"
    )


@pytest.mark.slow
def test_streamed_load_of_pytorch_model_bin_peaks_as_from_safetensors(tmp_path, written, streamed):
    """torch.load(mmap=True) maps each .bin shard, so the load reads one tensor at a time as from safetensors: a
    load that read the shard whole (no mmap) would add the shard to the peak."""
    from loading_helpers import bin_copy

    bin_dir = bin_copy(written, tmp_path / "bin", shards=2)
    from_bin, from_safetensors = _run("stream", bin_dir), streamed
    size = from_bin["fp32_model_bytes"]
    assert from_bin["added_peak_bytes"] < 0.35 * size, from_bin
    both = (from_bin, from_safetensors)
    assert from_bin["added_peak_bytes"] < from_safetensors["added_peak_bytes"] + 16 * 2**20, both
    print(
        f"\nfp32 model {size / 2**20:.0f} MiB; nf4-dq streamed load adds: from 2 .bin shards"
        f" {from_bin['added_peak_bytes'] / 2**20:.0f} MiB, from safetensors"
        f" {from_safetensors['added_peak_bytes'] / 2**20:.0f} MiB"
    )
