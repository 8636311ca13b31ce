"""LightningCLI's ``--optimizer`` under this package's strategies: the optimizer holds the parameters that train.

LightningCLI built it when the classes were instantiated, before the strategy quantized the base and added the
adapters: the quick-start's optimizer held 21 tensors, none of its 28 trainable ones, so nothing trained and
nothing said so; ``CausalLM``, which builds its model in ``configure_model``, had no parameter yet.
"""

from pathlib import Path

import pytest
import torch
from lightning.pytorch.callbacks import Callback
from loading_helpers import causal_lm_fit_args, save_pretrained_dir, write_prompt_completion

from pl_lowprec.cli import build_cli

pytest.importorskip("peft")
ROOT = Path(__file__).resolve().parents[2]


class HeldByTheOptimizer(Callback):
    """What the optimizer holds when training starts, and the trainable parameters before and after."""

    def on_train_start(self, trainer, pl_module):
        optimizer = trainer.optimizers[0]
        self.held = {id(p) for group in optimizer.param_groups for p in group["params"]}
        self.trainable = {name: p for name, p in pl_module.named_parameters() if p.requires_grad}
        self.before = {name: p.detach().clone() for name, p in self.trainable.items()}
        self.optimizer = optimizer


def fit(args, tmp_path) -> HeldByTheOptimizer:
    held = HeldByTheOptimizer()
    common = ["--trainer.max_steps=2", "--trainer.limit_val_batches=0", f"--trainer.default_root_dir={tmp_path}"]
    assert args[0] == "fit"  # run=False: no subcommand, as LightningCLI reads it
    cli = build_cli([*args[1:], *common, "--optimizer=torch.optim.AdamW", "--optimizer.lr=0.01"], run=False)
    cli.trainer.callbacks.append(held)
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    assert cli.trainer.global_step == 2
    return held


def check_trains_the_adapters(held: HeldByTheOptimizer) -> None:
    assert type(held.optimizer).__name__ == "AdamW" and held.optimizer.param_groups[0]["lr"] == 0.01
    assert held.held == {id(p) for p in held.trainable.values()}  # exactly the parameters that train
    assert any("lora_" in name for name in held.trainable)
    moved = [name for name, p in held.trainable.items() if not torch.equal(p.detach(), held.before[name])]
    assert moved and all("lora_" in name for name in moved)


def test_the_quickstart_module_built_in_init(tmp_path):
    config = ["fit", f"--config={ROOT / 'configs/quickstart.yaml'}", "--trainer.enable_progress_bar=false"]
    with pytest.warns(UserWarning, match=r"--optimizer replaces TinyLlama.configure_optimizers"):
        check_trains_the_adapters(fit(config, tmp_path))


def test_causal_lm_which_builds_its_model_in_configure_model(tmp_path):
    pretrained = save_pretrained_dir(tmp_path / "pretrained")
    args = causal_lm_fit_args(pretrained, write_prompt_completion(tmp_path / "pc.jsonl"))
    lora = ["--trainer.strategy=pl_lowprec.LowPrecisionStrategy", "--trainer.strategy.lora={r: 4, lora_alpha: 8}"]
    check_trains_the_adapters(fit([*args, *lora], tmp_path))
