"""CausalLM(loss_kernel=...): Liger-Kernel's fused linear cross-entropy against the chunked PyTorch loss.

Liger's kernel is Triton (CUDA only). On the CPU the wiring is checked with a reference implementation standing
in for the kernel (the same signature and semantics: summed cross-entropy of ``input @ weight.T + bias``, ``-100``
ignored): what reaches the kernel and what comes back must train exactly as the PyTorch path. The ``cuda`` tests
call the real kernel and compare it with the PyTorch path on the same GPU.
"""

import json
import logging

import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch import seed_everything
from lightning_helpers import quiet_trainer
from lightning_utilities.core.imports import RequirementCache
from loading_helpers import llama_config, save_pretrained_dir
from qlora_helpers import GradRecorder, LossRecorder

from pl_lowprec import AMPPrecision, LowPrecisionStrategy
from pl_lowprec.models import liger_loss
from pl_lowprec.models.chunked_loss import causal_lm_loss_sum
from pl_lowprec.models.liger_loss import check_head, choose_loss_kernel, liger_loss_sum

pytest.importorskip("transformers")
pytest.importorskip("peft")
pytest.importorskip("bitsandbytes")

ON_GPU = pytest.param("gpu", marks=pytest.mark.cuda)
LIGER_INSTALLED = bool(RequirementCache("liger-kernel"))


def reference_kernel(calls):
    """``liger_fused_linear_cross_entropy``'s signature and semantics in plain PyTorch; records each call."""

    def fused_linear_cross_entropy(input, weight, target, bias=None, ignore_index=-100, reduction="mean", **kwargs):
        calls.append({"input": input, "weight": weight, "target": target, "bias": bias, **kwargs})
        calls[-1].update(ignore_index=ignore_index, reduction=reduction)
        logits = F.linear(input, weight, bias)
        return F.cross_entropy(logits.float(), target, ignore_index=ignore_index, reduction=reduction)

    return fused_linear_cross_entropy


@pytest.fixture
def reference_liger(monkeypatch):
    """The kernel replaced by the reference, and the CPU allowed: only the kernel call itself is not exercised."""
    calls = []
    monkeypatch.setattr(liger_loss, "device_problem", lambda device: None)
    monkeypatch.setattr(liger_loss, "import_liger_fused_linear_cross_entropy", lambda: reference_kernel(calls))
    return calls


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory):
    return save_pretrained_dir(tmp_path_factory.mktemp("pretrained"), hidden_size=32, layers=2)


def _fit(pretrained, tmp_path, loss_kernel, accelerator="cpu", steps=2):
    from pl_lowprec.data import TextDataModule
    from pl_lowprec.models import CausalLM

    path = tmp_path / "pc.jsonl"
    rows = [{"prompt": f"def f{i}(x):\n    return", "completion": f" x + {i}"} for i in range(10, 18)]
    path.write_text("\n".join(json.dumps(r) for r in rows))
    data = TextDataModule(train_files=path, tokenizer=str(pretrained), batch_size=4, val_fraction=0, seed=0)
    seed_everything(0)
    model = CausalLM(str(pretrained), lr=1e-2, warmup_steps=1, loss_chunk_size=8, loss_kernel=loss_kernel)
    grads, losses = GradRecorder(), LossRecorder()
    strategy = LowPrecisionStrategy(
        quantization="nf4-dq", lora={"r": 8}, activation_checkpointing=["LlamaDecoderLayer"]
    )
    trainer = quiet_trainer(
        accelerator=accelerator,
        strategy=strategy,
        plugins=[AMPPrecision("bf16-mixed")],
        max_steps=steps,
        callbacks=[grads, losses],
    )
    trainer.fit(model, datamodule=data)
    return model, trainer, grads.grads, losses.losses


def test_a_loss_kernel_that_does_not_exist_is_refused_naming_the_choices(pretrained):
    from pl_lowprec.models import CausalLM

    with pytest.raises(ValueError, match=r"loss_kernel='triton'\) is not valid: use 'torch' .*'liger' .*'auto'"):
        CausalLM(str(pretrained), loss_kernel="triton")


def test_liger_on_the_cpu_is_refused_before_any_step_and_auto_keeps_torch_saying_why(pretrained, tmp_path, caplog):
    with pytest.raises(
        RuntimeError, match=r"loss_kernel='liger'\): Liger-Kernel's kernels .* CUDA GPUs only, and this"
    ):
        _fit(pretrained, tmp_path, "liger")
    with caplog.at_level(logging.INFO, logger="lightning.pytorch.utilities.rank_zero"):
        model, trainer, _, _ = _fit(pretrained, tmp_path, "auto", steps=1)
    said = [r.getMessage() for r in caplog.records if "loss_kernel='auto'" in r.getMessage()]
    assert said == [
        "CausalLM(loss_kernel='auto'): Liger-Kernel's kernels are written in Triton and run on CUDA GPUs only, and"
        " this run is on cpu; the loss runs as PyTorch's cross-entropy."
    ]
    assert trainer.global_step == 1 and model.loss_kernel_in_use == "torch"


@pytest.mark.skipif(LIGER_INSTALLED, reason="Liger-Kernel is installed here")
def test_liger_missing_on_a_gpu_is_refused_with_the_install_command():
    with pytest.raises(RuntimeError, match=r'Liger-Kernel is not installed .*pip install "pl_lowprec\[liger\]"'):
        choose_loss_kernel("liger", torch.device("cuda"))
    assert choose_loss_kernel("auto", torch.device("cuda")) == "torch"


def test_a_head_liger_cannot_read_is_refused_or_kept_on_torch(caplog):
    import bitsandbytes as bnb

    quantized = bnb.nn.Linear4bit(16, 32, bias=False)
    with pytest.raises(ValueError, match=r"the output head is a Linear4bit, not a plain torch.nn.Linear .*='torch'"):
        check_head("liger", "liger", quantized)
    with caplog.at_level(logging.INFO, logger="lightning.pytorch.utilities.rank_zero"):
        assert check_head("auto", "liger", quantized) == "torch"
    assert "the loss runs as PyTorch's cross-entropy" in caplog.text
    assert check_head("liger", "liger", torch.nn.Linear(16, 32)) == "liger"


def test_liger_path_trains_as_the_torch_path(pretrained, tmp_path, reference_liger, caplog):
    """bf16-mixed QLoRA: the frozen bf16 head, bf16 hidden states; losses and adapter gradients as PyTorch's."""
    _, _, expected, expected_losses = _fit(pretrained, tmp_path, "torch")
    with caplog.at_level(logging.INFO, logger="lightning.pytorch.utilities.rank_zero"):
        model, _, grads, losses = _fit(pretrained, tmp_path, "liger")
    assert (
        model.loss_kernel_in_use == "liger" and "fused linear cross-entropy (the logits are never held" in caplog.text
    )
    call = reference_liger[0]
    head = model.model.get_output_embeddings()
    assert call["weight"] is head.weight and call["bias"] is None and not head.weight.requires_grad
    assert call["input"].dim() == 2 and call["input"].is_contiguous() and call["input"].dtype == torch.bfloat16
    assert call["target"].dim() == 1 and (call["ignore_index"], call["reduction"]) == (-100, "sum")
    assert len(reference_liger) == 2  # one call per step: Liger chunks the rows itself
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected_losses), rtol=1e-6, atol=0)
    for step, step_expected in zip(grads, expected, strict=True):
        assert step.keys() == step_expected.keys() and len(step) == 2 * 7 * 2
        for name in step:
            torch.testing.assert_close(step[name], step_expected[name], rtol=1e-4, atol=1e-7, msg=name)


def _head_case(case: str, device: str):
    """A Llama's hidden states and head as CausalLM sees them under bf16-mixed: a frozen bf16 head (QLoRA), a
    trained fp32 head (full fine-tune), or a trained head tied to the input embeddings."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(llama_config(hidden_size=64, layers=1, tie=case == "tied", vocab_size=1000)).to(device)
    head = model.get_output_embeddings()
    if case == "frozen":
        head.to(torch.bfloat16).requires_grad_(False)
    hidden = torch.randn(2, 48, 64, device=device, dtype=torch.bfloat16, requires_grad=True)
    labels = torch.randint(0, 1000, (2, 48), device=device)
    labels[0, :10] = -100  # a prompt: no loss
    return model, head, hidden, labels


def _loss_and_grads(loss_sum, model, head, hidden, labels, device):
    hidden.grad = None
    model.zero_grad()
    with torch.autocast(device, dtype=torch.bfloat16):
        loss, tokens = loss_sum(head, hidden, labels)
    (loss * 0.37).backward()  # a factor like TokenMeanLoss's: the kernel scales its saved gradients by it
    grads = {"hidden": hidden.grad.clone()}
    if head.weight.requires_grad:
        grads["head"] = head.weight.grad.clone()
    return loss.detach(), tokens, grads


def _relative_error(actual, expected):
    """Of the norm; 0 where both are 0 (peft starts B at zero, so A's first gradient is exactly 0)."""
    return float((actual.float() - expected.float()).norm() / expected.float().norm().clamp(min=1e-12))


@pytest.mark.parametrize("case", ["frozen", "trained", "tied"])
@pytest.mark.parametrize("device", ["cpu", ON_GPU])
def test_liger_loss_sum_matches_the_chunked_loss(case, device, monkeypatch):
    """On the CPU against the reference kernel, on a GPU the real Liger kernel. The gradients are bf16 matmuls of
    other groups of rows (the chunked path rounds each chunk's head gradient to bf16 before summing them: 0.3% on
    the CPU), so a bf16 tolerance."""
    device = "cuda" if device == "gpu" else "cpu"
    if device == "cuda" and not LIGER_INSTALLED:
        pytest.skip("needs liger-kernel (pip install 'pl_lowprec[liger]')")
    if device == "cpu":
        monkeypatch.setattr(liger_loss, "import_liger_fused_linear_cross_entropy", lambda: reference_kernel([]))
    model, head, hidden, labels = _head_case(case, device)
    chunked = lambda h, x, y: causal_lm_loss_sum(h, x, y, chunk_size=16)  # noqa: E731
    loss_ref, tokens_ref, grads_ref = _loss_and_grads(chunked, model, head, hidden, labels, device)
    loss, tokens, grads = _loss_and_grads(liger_loss_sum, model, head, hidden, labels, device)
    assert tokens == tokens_ref == 2 * 47 - 9 and loss.dtype == torch.float32
    torch.testing.assert_close(loss, loss_ref, rtol=2e-3 if device == "cuda" else 1e-5, atol=0)
    assert grads.keys() == grads_ref.keys() == ({"hidden"} if case == "frozen" else {"hidden", "head"})
    if case == "tied":
        assert head.weight is model.get_input_embeddings().weight
    for name, grad in grads.items():
        assert _relative_error(grad, grads_ref[name]) < 2e-2, name


@pytest.mark.cuda
@pytest.mark.skipif(not LIGER_INSTALLED, reason="needs liger-kernel (pip install 'pl_lowprec[liger]')")
def test_causal_lm_with_the_liger_kernel_trains_as_with_torch_on_a_gpu(pretrained, tmp_path):
    _, _, expected, expected_losses = _fit(pretrained, tmp_path, "torch", accelerator="gpu")
    model, _, grads, losses = _fit(pretrained, tmp_path, "liger", accelerator="gpu")
    assert model.loss_kernel_in_use == "liger"
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected_losses), rtol=1e-2, atol=0)
    first, first_expected = grads[0], expected[0]  # the first step: the same weights, only the kernels differ
    for name in first:
        assert _relative_error(first[name], first_expected[name]) < 3e-2, name
