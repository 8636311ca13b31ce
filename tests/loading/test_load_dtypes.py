"""The dtype a streamed load gives each tensor is said, and a cast (or a file) that leaves inf or NaN in a parameter
is refused naming the key and file: transformers' ``from_pretrained(dtype=torch.float16)`` casts a bfloat16
checkpoint's values past 65504 to inf without a word, and training then runs on them."""

from __future__ import annotations

import logging

import pytest
import torch
from loading_helpers import rewrite_weights, save_llama
from qlora_helpers import tiny_llama
from torch.profiler import profile

from pl_lowprec.loading import empty_weights, load_pretrained
from pl_lowprec.loading.stream import FINITE_CHECK_SLICE, all_finite

pytest.importorskip("transformers")
NORM = "model.layers.0.post_attention_layernorm.weight"


def _meta_llama(dtype: torch.dtype) -> torch.nn.Module:
    with empty_weights():
        return tiny_llama().to(dtype)


def _with_values(directory, values: list[float]):
    def edit(state):
        state[NORM][: len(values)] = torch.tensor(values, dtype=state[NORM].dtype)
        return state

    return rewrite_weights(directory, edit)


def test_values_past_float16s_range_are_refused_naming_the_key_the_file_and_the_fix(tmp_path):
    directory = _with_values(save_llama(tmp_path / "ckpt", dtype=torch.bfloat16), [1e5, -7e4])
    with pytest.raises(ValueError, match="past float16's range") as refused:
        load_pretrained(_meta_llama(torch.float16), directory, "model.")
    message = str(refused.value)
    assert f"'{NORM}' in {directory / 'model.safetensors'}" in message
    assert "from bfloat16 to float16" in message and "precision='bf16-true'" in message
    loaded = _meta_llama(torch.bfloat16)  # the same checkpoint in bfloat16: as stored
    load_pretrained(loaded, directory, "model.")
    assert loaded.model.model.layers[0].post_attention_layernorm.weight[0].item() == 99840.0


def test_inf_or_nan_stored_in_the_file_is_refused_as_a_damaged_checkpoint(tmp_path):
    directory = _with_values(save_llama(tmp_path / "ckpt"), [float("nan"), float("inf")])
    with pytest.raises(ValueError, match=r"holds 2 inf or NaN values in the file itself"):
        load_pretrained(_meta_llama(torch.float32), directory, "model.")


@pytest.mark.parametrize(
    ("stored", "declared", "said"),
    [
        (torch.bfloat16, torch.float32, "cast to the dtypes the module declares (21 from bfloat16 to float32)"),
        (torch.float32, torch.bfloat16, "cast to the dtypes the module declares (21 from float32 to bfloat16)"),
        (torch.bfloat16, torch.bfloat16, ", in bfloat16 as stored."),
    ],
)
def test_the_load_line_says_the_stored_dtype_and_any_cast(tmp_path, caplog, stored, declared, said):
    directory = save_llama(tmp_path / "ckpt", dtype=stored)
    with caplog.at_level(logging.INFO, logger="lightning.pytorch.utilities.rank_zero"):
        load_pretrained(_meta_llama(declared), directory, "model.")
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("Loaded "))
    assert said in line, line


def _largest_allocation(work) -> int:
    with profile(profile_memory=True) as profiler:
        work()
    return max((event.cpu_memory_usage for event in profiler.key_averages()), default=0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_the_finite_check_of_a_finite_tensor_allocates_nothing_tensor_sized(dtype):
    weights = torch.randn(4 * FINITE_CHECK_SLICE).to(dtype)  # 8-16 MiB a tensor: a float32 copy or mask would show
    assert all_finite(weights)
    assert _largest_allocation(lambda: all_finite(weights)) < 1024


@pytest.mark.parametrize("bad", [float("inf"), float("nan")])
def test_the_finite_check_finds_one_bad_value_in_the_last_slice_and_passes_an_overflowing_finite_sum(bad):
    weights = torch.zeros(3 * FINITE_CHECK_SLICE, dtype=torch.float16)
    weights[-1] = bad
    assert not all_finite(weights)
    large = torch.full((3 * FINITE_CHECK_SLICE,), 60000.0, dtype=torch.float16)  # finite; its sum is inf in fp16
    assert not torch.isfinite(large.sum()) and all_finite(large)
