"""lowprec_fsdp resumes the optimizer state of a checkpoint written on one device or by lowprec_ddp (keyed by
position), as it resumes its own (keyed by parameter name)."""

import pytest
import torch
from torch import nn

from pl_lowprec.strategies.fsdp_checkpoints import load_optimizer_states, optimizer_state


def _trained() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    module[0].weight.requires_grad_(False)  # frozen, as a base weight: not in the optimizer
    optimizer = torch.optim.AdamW([p for p in module.parameters() if p.requires_grad], lr=0.1)
    for _ in range(2):
        module(torch.randn(3, 4)).square().sum().backward()
        optimizer.step()
        optimizer.zero_grad()
    return module, optimizer


def _fresh() -> tuple[nn.Module, torch.optim.Optimizer]:
    module = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    module[0].weight.requires_grad_(False)
    return module, torch.optim.AdamW([p for p in module.parameters() if p.requires_grad], lr=0.1)


@pytest.mark.parametrize("saved_by", ["one device or lowprec_ddp", "lowprec_fsdp"])
def test_optimizer_state_keyed_by_position_or_name_loads_into_the_same_parameters(saved_by):
    # A lowprec_fsdp resume from a lowprec / lowprec_ddp checkpoint stopped in "KeyError: 'state.0.step'" inside
    # torch's set_optimizer_state_dict (measured on 2 gloo ranks: CausalLM, full fine-tune and LoRA).
    module, optimizer = _trained()
    saved = optimizer.state_dict() if saved_by.startswith("one") else optimizer_state(module, optimizer)
    resumed_module, resumed = _fresh()
    load_optimizer_states(resumed_module, [resumed], [saved])
    expected = optimizer.state_dict()["state"]
    got = resumed.state_dict()["state"]
    assert sorted(got) == sorted(expected) == [0, 1, 2]  # bias 0, weight 2, bias 2: by position, frozen left out
    for key in expected:
        for name in ("step", "exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(got[key][name], expected[key][name], rtol=0, atol=0)


def test_optimizer_state_of_other_parameter_groups_is_refused_in_one_paragraph():
    _, optimizer = _trained()
    saved = optimizer.state_dict()
    resumed_module, _ = _fresh()
    resumed_module[0].weight.requires_grad_(True)  # e.g. other lora= settings: one more parameter trains
    resumed = torch.optim.AdamW([p for p in resumed_module.parameters() if p.requires_grad], lr=0.1)
    with pytest.raises(ValueError, match=r"parameter groups of \[3\] parameters; this run's optimizer has \[4\]"):
        load_optimizer_states(resumed_module, [resumed], [saved])


def _one_step(module: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    torch.manual_seed(1)
    module(torch.randn(3, 4)).square().sum().backward()
    optimizer.step()
    optimizer.zero_grad()


def test_an_optimizer_saved_before_its_first_step_restores_as_torch_restores_it():
    """torch's get_optimizer_state_dict fills an optimizer without state with a zero step of its own (AdamW: step 1,
    zero moments), in the live optimizer too, and set_optimizer_state_dict does the same before loading. Saved
    before the first step (LearningRateFinder's save in on_fit_start) and restored after its trial steps, the run
    went on with step 1 where lowprec_ddp and one device start at 0: its first update was 0.74 of theirs (measured
    on 2 gloo ranks: the loss after lr finding differed from lowprec_ddp's and Lightning's ddp)."""
    module, optimizer = _fresh()
    saved = optimizer_state(module, optimizer)
    assert not optimizer.state  # saving leaves the live optimizer as it was
    expected_module, expected = _fresh()
    expected_module.load_state_dict(module.state_dict())
    fresh = expected.state_dict()
    _one_step(module, optimizer)  # the trial steps the restore undoes
    module.load_state_dict(expected_module.state_dict())
    load_optimizer_states(module, [optimizer], [saved])
    expected.load_state_dict(fresh)  # what one device and lowprec_ddp restore: an optimizer without state
    assert not optimizer.state
    _one_step(module, optimizer), _one_step(expected_module, expected)
    for got, want in zip(module.parameters(), expected_module.parameters(), strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
