"""The README's main command runs end to end through the console entry point (with fewer steps)."""

import re
import subprocess
import sys
from pathlib import Path

import pytest
from gguf_helpers import refusal_line

ROOT = Path(__file__).resolve().parents[2]


def test_quickstart_runs_through_python_dash_m(tmp_path, capsys):
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "pl_lowprec",
            "fit",
            "--config",
            str(ROOT / "configs/quickstart.yaml"),
            "--trainer.max_steps",
            "3",
            "--trainer.val_check_interval",
            "3",
            "--trainer.limit_val_batches",
            "1",
            "--trainer.enable_progress_bar",
            "false",
        ],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "AMPPrecision('auto') chose" in result.stdout + result.stderr  # it says which precision and why
    assert "Loss scale: none (no scaler); 0 of 3 optimizer steps had a non-finite loss." in result.stdout
    assert "params_quantized_4bit" in result.stdout  # the QLoRA quick-start really quantized
    assert "Memory, fit (cpu, 1 rank, max across ranks)" in result.stdout
    assert (tmp_path / "runs/lightning_logs/version_0/memory_summary.json").exists()
    assert "LeafSpec" not in result.stderr
    # the model summary's size is the bytes MemoryTracker counts in the parameters, not 4 bytes a packed weight
    summary_mb = float(re.search(r"Total estimated model params size \(MB\): ([\d.]+)", result.stdout).group(1))
    params_bytes = sum(int(b) for b in re.findall(r"^  params_\w+ +[\d.]+ +(\d+)$", result.stdout, re.MULTILINE))
    assert params_bytes > 0 and summary_mb == pytest.approx(params_bytes * 1e-6, abs=5e-4)
    assert "not supported by the model summary" not in result.stderr
    # the default root dir keeps logs and the saved config out of the working directory
    assert (tmp_path / "runs/lightning_logs/version_0/config.yaml").exists()
    assert not (tmp_path / "config.yaml").exists() and not (tmp_path / "lightning_logs").exists()
    # its model is built from a config, with no original weights to merge into: the refusal names the flag given.
    # In this process (the console path is the fit's above): a fresh interpreter imports torch again, seconds.
    (checkpoint,) = (tmp_path / "runs/lightning_logs/version_0/checkpoints").glob("*.ckpt")
    line = refusal_line(capsys, ["export", f"--ckpt_path={checkpoint}", f"--out={tmp_path / 'gguf'}", "--format=gguf"])
    assert "A GGUF export merges the adapters into the original pretrained weights" in line
    assert line.endswith("Export the adapter directory instead (leave out --format gguf).")


def test_step_limited_run_gets_a_sensible_progress_label(tmp_path):
    from lightning.pytorch.callbacks import RichProgressBar

    from pl_lowprec.callbacks import StepLimitedRichProgressBar
    from pl_lowprec.cli import build_cli

    config = str(ROOT / "configs/quickstart.yaml")
    cli = build_cli(["--config", config, "--trainer.default_root_dir", str(tmp_path)], run=False)
    bars = [c for c in cli.trainer.callbacks if isinstance(c, RichProgressBar)]
    assert len(bars) == 1 and isinstance(bars[0], StepLimitedRichProgressBar)
    bar = bars[0]
    bar._trainer = cli.trainer
    cli.trainer.fit_loop.max_epochs = -1  # what fit sets for a run limited by max_steps alone
    assert "/-2" in RichProgressBar._get_train_description(bar, 0)  # Lightning's own label for max_epochs=-1
    assert bar._get_train_description(0).strip() == "Epoch 0 (max_steps=200)"
