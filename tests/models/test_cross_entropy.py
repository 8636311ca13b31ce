"""``cross_entropy_sum`` is ``F.cross_entropy(logits.float(), reduction="sum")`` without fp32 logit copies."""

import pytest
import torch
import torch.nn.functional as F

from pl_lowprec.models import cross_entropy
from pl_lowprec.models.cross_entropy import cross_entropy_sum
from pl_lowprec.models.token_loss import IGNORE_INDEX


def _loss_and_grad(loss_fn, logits, targets):
    leaf = logits.detach().requires_grad_()
    loss = loss_fn(leaf, targets)
    loss.backward(torch.tensor(0.7))  # an upstream factor, as the token mean gives
    return loss.detach(), leaf.grad


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_equals_torch_cross_entropy_on_fp32_logits(monkeypatch, dtype):
    monkeypatch.setattr(cross_entropy, "ROW_ELEMENTS", 1000)  # 3 rows at a time: 13 groups
    generator = torch.Generator().manual_seed(0)
    logits = (torch.randn(37, 300, generator=generator) * 3).to(dtype)
    targets = torch.randint(0, 300, (37,), generator=generator)
    targets[[5, 9, 36]] = IGNORE_INDEX

    def reference(x, t):
        return F.cross_entropy(x.float(), t, ignore_index=IGNORE_INDEX, reduction="sum")

    loss, grad = _loss_and_grad(cross_entropy_sum, logits, targets)
    loss_ref, grad_ref = _loss_and_grad(reference, logits, targets)
    assert grad.dtype == dtype
    if dtype == torch.float32:  # F.cross_entropy itself
        torch.testing.assert_close((loss, grad), (loss_ref, grad_ref), rtol=0, atol=0)
    else:  # both compute in fp32; the reductions' order differs (a bf16 gradient is then rarely one rounding apart)
        torch.testing.assert_close(loss, loss_ref, rtol=1e-6, atol=0)
        torch.testing.assert_close(grad, grad_ref, rtol=2**-8, atol=1e-6)
    assert (grad[[5, 9, 36]] == 0).all()


def test_saves_only_the_logits_and_per_row_values():
    logits = torch.randn(64, 1000, dtype=torch.bfloat16, requires_grad=True)
    targets = torch.randint(0, 1000, (64,))
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        cross_entropy_sum(logits, targets)
    vocab_sized = [t for t in saved if t.numel() >= logits.numel()]
    assert len(vocab_sized) == 1 and vocab_sized[0].dtype == torch.bfloat16  # the logits, no fp32 copy
