"""The isolation check alone: samples found from restarting positions, the step stopped after its model call, and
nothing it touches (random generators, train mode, running statistics) changed afterwards."""

import pytest
import torch
from loading_helpers import llama_config
from packing_helpers import call_model
from torch import nn

from pl_lowprec.data.collate import PackedCollate
from pl_lowprec.data.isolation_check import check_isolation, hf_models, probe_row, sample_bounds
from pl_lowprec.data.packing import pack_row

pytest.importorskip("transformers")


def test_samples_start_where_positions_restart():
    assert sample_bounds(torch.tensor([0, 1, 2, 0, 1, 0, 0, 1])) == [(0, 3), (3, 5), (5, 6), (6, 8)]


def _sample(n: int, start: int, prompt: int = 0) -> dict[str, torch.Tensor]:
    ids = torch.arange(start, start + n) % 60 + 1
    labels = ids.clone()
    labels[:prompt] = -100
    return {"input_ids": ids, "labels": labels}


def _batch(*rows):
    return PackedCollate(pad_token_id=0)([pack_row(list(samples)) for samples in rows])


def test_the_probe_is_a_later_sample_with_targets_never_the_padding():
    single = _batch([_sample(7, 0)], [_sample(3, 10)])  # the second row ends in padding: a segment of no targets
    assert probe_row(single) is None
    packed = _batch([_sample(5, 0)], [_sample(2, 10), _sample(4, 20, prompt=4), _sample(3, 30)])
    probe = probe_row(packed)
    assert (probe.row, probe.start, probe.end) == (1, 6, 9)  # the prompt-only sample (3 to 6) has no target


class Step(nn.Module):
    """A step as users write it: batch norm on something first, then the model, then what must not run."""

    def __init__(self, call: str, attention_dropout: float = 0.0) -> None:
        super().__init__()
        from transformers import LlamaForCausalLM

        config = llama_config(hidden_size=32, vocab_size=64, attention_dropout=attention_dropout)
        self.model = LlamaForCausalLM(config)  # config.use_cache=True, as hub models
        self.norm = nn.BatchNorm1d(4)
        self.call = call
        self.after_the_model: list[float] = []

    def __call__(self, batch):
        self.norm(torch.randn(8, 4))
        loss = call_model(self.model, batch, self.call).loss
        self.after_the_model.append(loss.item())
        return loss


def _check(step: Step):
    batch = _batch([_sample(6, 0), _sample(9, 20)], [_sample(12, 40)])
    return check_isolation(step, batch, probe_row(batch), step, hf_models(step))


@pytest.mark.parametrize(("call", "keeps_apart"), [("forward_batch", True), ("old advice", False)])
def test_a_leak_moves_the_later_sample_and_nothing_else_changes(call, keeps_apart):
    step = Step(call, attention_dropout=0.5)  # dropout: both runs must draw the same masks
    step.train()
    rng, running_mean = torch.get_rng_state(), step.norm.running_mean.clone()
    result = _check(step)
    assert result.observed and result.compared == 9 and result.keeps_apart is keeps_apart
    assert result.moved == (0 if keeps_apart else 9)
    assert step.after_the_model == []  # stopped when the model returned: no loss, log or backward after it
    assert torch.equal(torch.get_rng_state(), rng)
    assert torch.equal(step.norm.running_mean, running_mean) and step.norm.num_batches_tracked == 0
    assert step.training and step.model.training
    assert result.call.kwargs.get("use_cache") is (False if keeps_apart else None)


def test_a_step_that_calls_no_model_is_not_observed():
    step = Step("forward_batch")
    batch = _batch([_sample(6, 0), _sample(9, 20)])
    result = check_isolation(lambda b: None, batch, probe_row(batch), step, hf_models(step))
    assert not result.observed and result.call is None
