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
