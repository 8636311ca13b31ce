"""The examples do what they say: the plain loop is the one AMPPrecision reproduces, and the Transformer example
trains under fp16 AMP with checkpointing and reports its real loss scale and memory."""

import re
import subprocess
import sys
from pathlib import Path

import torch
from lightning_helpers import Classifier, quiet_trainer
from plain_amp_loop import make_classification_data, make_mlp
from plain_transformer_classifier import ParityClassifier, main
from torch import nn

from pl_lowprec import AMPPrecision
from pl_lowprec.transforms.checkpointing import is_checkpointed

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


class LossLog(Classifier):
    """Notes the loss of every micro-batch, as the plain loop does (unscaled, undivided)."""

    def __init__(self) -> None:
        super().__init__(make_mlp())
        self.losses: list[float] = []

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.losses.append(loss.item())
        return loss


def test_plain_amp_loop_script_prints_the_losses_of_the_plugin(tmp_path):
    script = subprocess.run(
        [sys.executable, str(EXAMPLES / "plain_amp_loop.py")], capture_output=True, text=True, cwd=tmp_path, timeout=300
    )
    assert script.returncode == 0, script.stderr[-3000:]
    printed = [float(m) for m in re.findall(r"^epoch \d: mean loss (\S+)$", script.stdout, re.MULTILINE)]

    # the script's settings (3 epochs of 256 samples, batches of 8, accumulate 4, clip 1.0, AdamW lr 1e-2)
    module = LossLog()
    loader = torch.utils.data.DataLoader(make_classification_data(n=256), batch_size=8)
    trainer = quiet_trainer(
        plugins=[AMPPrecision("16-mixed")], max_epochs=3, accumulate_grad_batches=4, gradient_clip_val=1.0
    )
    trainer.fit(module, loader)
    per_epoch = torch.tensor(module.losses).reshape(3, len(loader)).mean(1)

    assert printed == [round(v, 4) for v in per_epoch.tolist()]  # the same losses, micro-batch by micro-batch
    assert printed[0] > printed[1] > printed[2] and printed[2] < printed[0] / 2  # measured: 1.21, 0.59, 0.29


def test_transformer_example_trains_and_reports_its_real_scale_and_memory(capsys, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)  # MemoryTracker writes memory_summary.json into the working directory
    trainer = main(fast=True)  # the script's body: 4 steps, accumulate 2, fp16 AMP from init_scale 1024
    out = capsys.readouterr().out
    plugin, module = trainer.precision_plugin, trainer.lightning_module

    assert isinstance(module, ParityClassifier) and trainer.global_step == 4
    assert plugin.compute_dtype == torch.float16 and plugin._tracker.optimizer_steps == 4
    layers = [m for m in module.modules() if isinstance(m, nn.TransformerEncoderLayer)]
    assert len(layers) == 4 and all(is_checkpointed(m) for m in layers)

    # the printed numbers are the scaler's own: no overflow at 1024, no growth in 4 steps (growth_interval 2000)
    state = plugin.loss_scale_state()
    assert state.scale == plugin.scaler.get_scale() == 1024.0 and state.skipped_steps == 0
    line = re.search(r"^Loss scale: (\S+) at the end; (\d+) of (\d+) optimizer steps skipped", out, re.MULTILINE)
    assert line is not None, out
    assert (float(line[1]), int(line[2]), int(line[3])) == (state.scale, state.skipped_steps, trainer.global_step)

    # the memory table counts this model: 4 bytes per fp32 parameter, AdamW's two moments (and step) beside them
    params = sum(p.numel() for p in module.parameters())
    table = dict(re.findall(r"^\s+(\w+)\s+[\d.]+\s+(\d+)$", out, re.MULTILINE))
    assert int(table["params_float32"]) == int(table["gradients"]) == 4 * params
    assert 8 * params <= int(table["optimizer_state"]) <= 8 * params + 1024
