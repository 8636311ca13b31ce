"""checkpoint_mode="selective": same gradients as no checkpointing, saved bytes between "none" and "full", no
dequantized 4-bit weight kept, counted by the estimator, refused where it cannot run."""

import pytest
import torch
from qlora_helpers import tiny_llama

from pl_lowprec import estimate_memory, set_activation_checkpointing
from pl_lowprec.memory.activations import count_saved_tensors
from pl_lowprec.transforms.config import TransformConfig
from pl_lowprec.transforms.lora import inject_lora, lora_config

WIDTH = 256  # a dequantized fp32 weight (256 x 256: 256 KiB) is far larger than any activation of 8 tokens


def _llama(quantization=None):
    torch.manual_seed(0)
    model = tiny_llama(hidden_size=WIDTH, layers=2)
    if quantization == "bitsandbytes":
        pytest.importorskip("bitsandbytes")
        from pl_lowprec.transforms.quantization import QuantizationConfig, quantize_model

        quantize_model(model, QuantizationConfig.from_mode("nf4"), torch.float32, torch.device("cpu"))
    elif quantization == "torchao":
        pytest.importorskip("torchao")
        from pl_lowprec.transforms.nf4 import NF4Layout, quantize_model_nf4
        from pl_lowprec.transforms.quantization import QuantizationConfig

        quantize_model_nf4(model, QuantizationConfig.from_mode("nf4"), NF4Layout(), torch.device("cpu"), 1)
    inject_lora(model, lora_config({"r": 8}), ("lm_head",))
    return model


def _step(model, mode):
    if mode is not None:
        set_activation_checkpointing(model, "LlamaDecoderLayer", mode=mode)
    ids = torch.randint(0, 256, (1, 8), generator=torch.Generator().manual_seed(1))
    with count_saved_tensors(model) as counter:
        loss = model.model(input_ids=ids, labels=ids, use_cache=False).loss
    loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    return counter, grads


@pytest.mark.parametrize("quantization", [None, "bitsandbytes", "torchao"])
def test_same_gradients_and_saved_bytes_between_none_and_full(quantization):
    none, expected = _step(_llama(quantization), None)
    selective, actual = _step(_llama(quantization), "selective")
    full, _ = _step(_llama(quantization), "full")
    assert actual.keys() == expected.keys() and any("lora_A" in n for n in actual)
    for name in expected:
        torch.testing.assert_close(actual[name], expected[name], rtol=0, atol=0)
    assert full.nbytes < selective.nbytes < none.nbytes
    if quantization is not None:  # kept: activations only, no weight-sized (dequantized) tensor
        weight_bytes = WIDTH * WIDTH * 4
        assert selective.largest < weight_bytes / 8
        assert selective.nbytes == _step(_llama(None), "selective")[0].nbytes


def test_a_kept_dequantized_weight_would_be_seen():
    """The check above can fail: a policy that keeps every op's output keeps the dequantized weights too."""
    pytest.importorskip("torchao")
    from torch.utils.checkpoint import CheckpointPolicy

    from pl_lowprec.memory.activations import note_kept_outputs
    from pl_lowprec.transforms import selective_checkpointing

    def keep_everything(ctx, func, *args, **kwargs):
        if not ctx.is_recompute:
            note_kept_outputs(ctx.op_output)
        return CheckpointPolicy.MUST_SAVE

    original = selective_checkpointing.save_matmuls_and_attention
    selective_checkpointing.save_matmuls_and_attention = keep_everything
    try:
        counter, _ = _step(_llama("torchao"), "selective")
    finally:
        selective_checkpointing.save_matmuls_and_attention = original
    assert counter.largest >= WIDTH * WIDTH * 4


def test_the_estimate_counts_what_selective_keeps():
    build = lambda: tiny_llama(hidden_size=64, layers=2)  # noqa: E731
    batch = {"input_ids": torch.zeros(2, 33, dtype=torch.long)}
    args = {"activation_checkpointing": ["LlamaDecoderLayer"], "lora": {"r": 8}}
    full = estimate_memory(build, batch, checkpoint_mode="full", **args).activations
    selective = estimate_memory(build, batch, checkpoint_mode="selective", **args).activations
    none = estimate_memory(build, batch, lora={"r": 8}).activations
    assert full < selective < none
    model = _llama_at(64)
    set_activation_checkpointing(model, "LlamaDecoderLayer", mode="selective")
    with count_saved_tensors(model) as measured:
        model.training_step(batch, 0)
    assert abs(selective - measured.nbytes) <= 0.05 * measured.nbytes  # as close as the estimator's other figures


def _llama_at(width):
    torch.manual_seed(0)
    model = tiny_llama(hidden_size=width, layers=2)
    inject_lora(model, lora_config({"r": 8}), ("lm_head",))
    return model


def test_selective_with_reentrant_is_refused():
    with pytest.raises(
        ValueError, match=r"checkpoint_mode='selective' with checkpoint_impl='reentrant'.*non_reentrant"
    ):
        TransformConfig(activation_checkpointing="Block", checkpoint_mode="selective", checkpoint_impl="reentrant")


def test_selective_without_blocks_and_unknown_modes_are_refused():
    with pytest.raises(ValueError, match=r"checkpoint_mode='selective' was given without activation_checkpointing="):
        TransformConfig(checkpoint_mode="selective")
    with pytest.raises(
        ValueError, match=r"checkpoint_every_n=2 was given without activation_checkpointing=: .*nothing"
    ):
        TransformConfig(checkpoint_every_n=2)  # accepted and ignored before
    with pytest.raises(ValueError, match=r"checkpoint_mode='ops' is not valid: use 'full'.*or 'selective'"):
        TransformConfig(activation_checkpointing="Block", checkpoint_mode="ops")
