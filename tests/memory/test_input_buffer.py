"""A tied weight's two gradients are summed in place, as the autograd engine sums them in a real step: the
estimate of a tied model's full fine-tune against the profiler's peak through Lightning's fit loop."""

import functools

import lightning.pytorch as pl
import pytest
import torch
from fit_peak_helpers import ids_loader, measured_fit_peak
from torch import nn
from torch.nn import functional as F

from pl_lowprec import LowPrecisionStrategy, estimate_memory

VOCAB, HIDDEN, ROWS, SEQ = 8192, 64, 2, 8  # the embedding dominates, as in a small model's full fine-tune


class HeadFunction(torch.autograd.Function):
    """``hidden @ weight.T`` whose backward forms the weight's gradient as one fresh tensor, as CausalLM's
    chunked loss does (``torch.nn.functional.linear`` hands autograd a transposed view instead)."""

    @staticmethod
    def forward(ctx, hidden, weight):
        ctx.save_for_backward(hidden, weight)
        return hidden @ weight.t()

    @staticmethod
    def backward(ctx, grad):
        hidden, weight = ctx.saved_tensors
        return grad @ weight, grad.flatten(0, -2).t().mm(hidden.flatten(0, -2))


class TiedLM(pl.LightningModule):
    """An embedding, one layer, and the embedding again as the output head (SmolLM2's and Qwen2.5's tying)."""

    def __init__(self, head=HeadFunction.apply) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.layer = nn.Linear(HIDDEN, HIDDEN)
        self.head = head

    def training_step(self, batch, batch_idx):
        ids = batch["input_ids"]
        logits = self.head(torch.tanh(self.layer(self.embed(ids))), self.embed.weight)
        return F.cross_entropy(logits.flatten(0, 1), ids.flatten())

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=1e-3)


HEADS = {
    "a fresh gradient, summed in place": HeadFunction.apply,
    "a transposed view (F.linear), summed into a new tensor": F.linear,
}


@pytest.mark.parametrize("head", HEADS, ids=str)
def test_a_tied_weight_is_estimated_as_the_measured_peak(head):
    loader = ids_loader(4, ROWS, SEQ, VOCAB)
    build = functools.partial(TiedLM, HEADS[head])
    estimate = estimate_memory(build, next(iter(loader)), device="cpu")
    measured = measured_fit_peak(build, loader, strategy=LowPrecisionStrategy())
    assert estimate.peak == pytest.approx(measured, rel=0.01), (estimate.peak, measured, estimate.table())
