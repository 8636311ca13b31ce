"""The headline numbers of the usual mixed-precision and QLoRA tutorials, measured through the package.

Users arrive with them (docs/precision.md, "Against the usual tutorials"): "mixed precision holds 16 bytes per
trained parameter, as fp32 does" (its memory saving is in the activations, not in weights, gradients and AdamW
state; a tutorial that counts 2 + 2 + 8 bytes for fp16 AMP forgets the fp32 weights autocast reads from), "8-bit
Adam holds 2 bytes per parameter, not 8", and "double quantization stores the 4-bit constants in 8 bits: 437 MB of
fp32 scales of a 7B model become 109 MB". The loops themselves (GradScaler with unscale_, clipping and
accumulation) are tests/plugins/test_amp_equivalence.py and tests/test_examples.py, bit for bit; the one loop
they teach that Lightning's accumulation does not run, the undivided loss, is reproduced here.
"""

import copy
import functools

import pytest
import torch
import torch.nn.functional as F
from lightning_helpers import Classifier, quiet_trainer
from plain_amp_loop import make_classification_data, make_mlp
from torch import nn
from transformers import LlamaConfig

from pl_lowprec import AMPPrecision, estimate_memory
from pl_lowprec.demo import TinyLlama
from pl_lowprec.memory.breakdown import optimizer_state_bytes, parameter_bytes
from pl_lowprec.models import CausalLM
from pl_lowprec.transforms.optimizers import swap_optimizer
from pl_lowprec.transforms.quantization import QuantizationConfig, quantize_model

SIZES = {"hidden_size": 128, "intermediate_size": 256, "num_layers": 2, "max_len": 16}


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed", "16-mixed"])
def test_mixed_precision_holds_sixteen_bytes_per_trained_parameter_as_fp32_does(precision):
    batch = {"input_ids": torch.zeros(2, 16, dtype=torch.long)}
    estimate = estimate_memory(lambda: TinyLlama(**SIZES), batch, precision=precision, device="cpu")
    params = sum(p.numel() for p in TinyLlama(**SIZES).parameters())
    tensors = len(list(TinyLlama(**SIZES).parameters()))
    assert estimate.weights == {"float32": 4 * params}  # the fp32 weights autocast casts from: no fp16 model copy
    assert estimate.gradients == 4 * params  # gradients of fp32 weights are fp32
    assert estimate.optimizer_state == 8 * params + 4 * tensors  # AdamW's two fp32 moments (and its step counts)


def test_eight_bit_adamw_holds_a_quarter_of_adamws_state():
    weight = nn.Parameter(torch.randn(256, 256))  # 65,536 elements: over bitsandbytes' min_8bit_size of 4096
    small = nn.Parameter(torch.randn(4095))  # under it: bitsandbytes keeps 32-bit state, as the configs say
    optimizer = swap_optimizer(torch.optim.AdamW([weight, small], lr=1e-3), "adamw8bit", torch.device("cpu"))
    (weight.sum() + small.sum()).backward()
    optimizer.step()
    eight_bit = optimizer_state_bytes([optimizer]) - 8 * small.numel()
    full = 8 * weight.numel()
    assert {t.dtype for t in optimizer.state[small].values() if torch.is_tensor(t) and t.numel() == small.numel()} == {
        torch.float32
    }
    assert 0.25 <= eight_bit / full <= 0.26, eight_bit / full  # 2 bytes a parameter, plus a scale per block


def _constant_bits_per_weight(mode: str) -> float:
    model = TinyLlama(hidden_size=512, intermediate_size=1408, num_layers=2, num_heads=8).model
    quantized = sum(m.weight.numel() for n, m in model.named_modules() if type(m) is nn.Linear and "lm_head" not in n)
    quantize_model(model, QuantizationConfig.from_mode(mode), torch.float32, torch.device("cpu"))
    return 8 * parameter_bytes(model)["quantized_4bit"] / quantized - 4  # bits beyond the 4 of each weight


def test_double_quantization_saves_the_tutorials_three_eighths_of_a_bit_per_weight():
    plain, double = _constant_bits_per_weight("nf4"), _constant_bits_per_weight("nf4-dq")
    assert plain == pytest.approx(0.5, abs=0.002)  # an fp32 absmax per 64 weights: 7B x 0.5 bits = 437 MB
    assert plain - double == pytest.approx(0.373, abs=0.005)  # 8-bit absmax, fp32 per 256 of them: 328 MB saved


class SummedWindowLoss(Classifier):
    """Returns ``loss * N``: Lightning divides it by N again, so the window's gradient is the sum of its losses'."""

    def training_step(self, batch, batch_idx):
        return super().training_step(batch, batch_idx) * self.trainer.accumulate_grad_batches

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr)  # a gradient N times larger moves N times further


def test_the_undivided_accumulation_loop_is_a_training_step_returning_loss_times_n():
    """The tutorial loop ``scaler.scale(loss).backward()`` every micro-batch, ``scaler.step`` and ``update`` every N:
    its gradient is N times Lightning's, and ``loss * N`` gives the same parameters (fp16, dynamic scale)."""
    accumulate, batches = 4, 16
    loader = torch.utils.data.DataLoader(make_classification_data(n=batches * 8), batch_size=8)
    reference = make_mlp()
    model = copy.deepcopy(reference)
    optimizer = torch.optim.SGD(reference.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu")
    for i, (x, y) in enumerate(loader):
        with torch.autocast("cpu", dtype=torch.float16):
            loss = F.cross_entropy(reference(x), y)
        scaler.scale(loss).backward()
        if (i + 1) % accumulate == 0:
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad()

    module = SummedWindowLoss(model, lr=1e-2)
    trainer = quiet_trainer(plugins=[AMPPrecision("16-mixed")], max_epochs=1, accumulate_grad_batches=accumulate)
    trainer.fit(module, loader)
    for ours, theirs in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=0)


def test_the_tutorials_seven_b_on_a_six_gb_card_recipe_is_predicted_to_fit(tmp_path):
    """ "Train a 7B model on a 6 GB card" (Llama-2-7B, nf4 with double quantization, LoRA r=8 on q_proj and v_proj,
    batch 1 x 256, bf16, paged 8-bit AdamW, gradient checkpointing; the tutorial reports a ~5.8 GB peak): predicted
    from its config.json alone, 3.82 GiB of tensors, leaving a 6 GB card room for CUDA's context."""
    LlamaConfig(
        hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32, vocab_size=32000
    ).save_pretrained(tmp_path)
    ids = torch.zeros(1, 256, dtype=torch.long)
    estimate = estimate_memory(
        functools.partial(CausalLM, pretrained=str(tmp_path)),
        {"input_ids": ids, "labels": ids},
        precision="bf16-mixed",
        device="cuda",
        quantization="nf4-dq",
        lora={"r": 8, "lora_alpha": 16, "lora_dropout": 0.05, "target_modules": ["q_proj", "v_proj"]},
        activation_checkpointing=["LlamaDecoderLayer"],
        optimizer="paged_adamw8bit",
    )
    assert sum(estimate.weights.values()) / 2**30 == pytest.approx(3.62, abs=0.02)  # 4-bit base, bf16 embeddings
    assert estimate.peak / 2**30 < 4.5, estimate.table()  # 3.82 predicted; 4.87 without checkpointing
