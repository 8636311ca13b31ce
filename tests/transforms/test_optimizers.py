"""optimizer=: the configured AdamW becomes bitsandbytes', keeping groups, hyperparameters and the schedule."""

import warnings

import pytest
import torch
from lightning_helpers import quiet_trainer
from qlora_helpers import ids_loader, tiny_llama

from pl_lowprec import AMPPrecision, LowPrecisionStrategy

bnb = pytest.importorskip("bitsandbytes")
pytest.importorskip("peft")


class TwoGroups(type(tiny_llama())):
    """AdamW with two parameter groups (different LR and weight decay) and a step LR schedule."""

    adamw_options: dict = {}  # noqa: RUF012 (set per test)

    def configure_optimizers(self):
        params = [(n, p) for n, p in self.named_parameters() if p.requires_grad]
        groups = [
            {"params": [p for n, p in params if "lora_A" in n], "lr": 1e-3, "weight_decay": 0.0},
            {"params": [p for n, p in params if "lora_A" not in n], "lr": 2e-3, "weight_decay": 0.05},
        ]
        opt = torch.optim.AdamW(groups, betas=(0.8, 0.95), eps=1e-7, **self.adamw_options)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def _fit(optimizer, steps=3, **adamw_options):
    model = TwoGroups(hidden_size=64, intermediate_size=192, num_layers=1, num_heads=4, max_len=64)
    model.adamw_options = adamw_options
    strategy = LowPrecisionStrategy(lora={"r": 64, "lora_alpha": 64}, optimizer=optimizer)
    trainer = quiet_trainer(strategy=strategy, plugins=[AMPPrecision("bf16-mixed")], max_steps=steps)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(model, ids_loader())
    return trainer, caught


def test_adamw8bit_keeps_groups_hyperparameters_and_schedule():
    trainer, caught = _fit("adamw8bit")
    opt = trainer.optimizers[0]
    assert isinstance(opt, bnb.optim.AdamW8bit)
    assert [g["lr"] for g in opt.param_groups] == [1e-3 * 0.5**3, 2e-3 * 0.5**3]  # three scheduler steps
    assert [g["weight_decay"] for g in opt.param_groups] == [0.0, 0.05]
    assert all(g["betas"] == (0.8, 0.95) and g["eps"] == 1e-7 for g in opt.param_groups)
    assert trainer.lr_scheduler_configs[0].scheduler.optimizer is opt
    big = [p for g in opt.param_groups for p in g["params"] if p.numel() >= 4096]
    assert big and all(opt.state[p]["state1"].dtype == torch.uint8 for p in big)  # 8-bit state
    assert not [w for w in caught if "lr_scheduler" in str(w.message)]  # no "step() overridden" warnings


def test_paged_falls_back_on_cpu_with_a_warning():
    trainer, caught = _fit("paged_adamw8bit", steps=1)
    assert type(trainer.optimizers[0]).__name__ == "AdamW8bit"
    messages = [str(w.message) for w in caught if "pages optimizer state" in str(w.message)]
    assert messages == [
        "optimizer='paged_adamw8bit' pages optimizer state through CUDA unified memory, which cpu"
        " does not have: using bitsandbytes.optim.AdamW8bit (same update, unpaged)."
    ]


def test_lion8bit(caplog):
    import logging

    with caplog.at_level(logging.INFO, logger="lightning.pytorch.utilities.rank_zero"):
        trainer, _ = _fit("lion8bit", steps=2)
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("Optimizer:")]
    assert len(said) == 1 and said[0].endswith("its authors use a 3-10x smaller learning rate and betas (0.9, 0.99).")
    assert isinstance(trainer.optimizers[0], bnb.optim.Lion8bit)
    assert trainer.optimizers[0].param_groups[1]["lr"] == 2e-3 * 0.5**2


def test_unknown_optimizer_name():
    with pytest.raises(ValueError, match=r"optimizer='adam8' is not supported. Allowed: 'adamw8bit'"):
        LowPrecisionStrategy(optimizer="adam8")


def test_non_adam_optimizer_is_refused():
    class SGDModule(type(tiny_llama())):
        def configure_optimizers(self):
            return torch.optim.SGD([p for p in self.parameters() if p.requires_grad], lr=0.1)

    model = SGDModule(hidden_size=64, intermediate_size=192, num_layers=1, num_heads=4, max_len=64)
    trainer = quiet_trainer(strategy=LowPrecisionStrategy(lora={"r": 4}, optimizer="adamw8bit"), max_steps=1)
    with pytest.raises(ValueError, match=r"replaces Adam or AdamW, but configure_optimizers returned SGD"):
        trainer.fit(model, ids_loader())


@pytest.mark.parametrize(
    ("name", "options", "said"),
    [
        ("adamw8bit", {"maximize": True}, r"AdamW\(maximize=True\), and optimizer='adamw8bit' has no such option: the"
         r" swapped optimizer would minimize"),
        ("torchao_adamw8bit", {"maximize": True}, r"AdamW\(maximize=True\), and optimizer='torchao_adamw8bit'"),
        ("adamw8bit", {"amsgrad": True}, r"AdamW\(amsgrad=True\), and optimizer='adamw8bit' has no such option: the"
         r" swapped optimizer would drop AMSGrad. Drop amsgrad=True from configure_optimizers, or drop optimizer="),
        ("torchao_adamw8bit", {"amsgrad": True}, r"AdamW\(amsgrad=True\), and optimizer='torchao_adamw8bit'"),
    ],
)  # fmt: skip
def test_an_option_the_swapped_optimizer_lacks_is_refused_before_the_first_step(name, options, said):
    """maximize=True became an 8-bit AdamW that minimized, amsgrad=True was dropped: both silently."""
    if name.startswith("torchao"):
        pytest.importorskip("torchao")
    with pytest.raises(ValueError, match=said):
        _fit(name, steps=1, **options)


def test_the_swap_is_said_in_one_line(caplog):
    pytest.importorskip("torchao")
    import logging

    with caplog.at_level(logging.INFO, logger="lightning.pytorch.utilities.rank_zero"):
        _fit("torchao_adamw8bit", steps=1)
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("Optimizer:")]
    assert said == [
        "Optimizer: AdamW from configure_optimizers replaced by torchao AdamW8bit (optimizer='torchao_adamw8bit')"
        " over the same 2 parameter groups, learning rates and schedule."
    ]
