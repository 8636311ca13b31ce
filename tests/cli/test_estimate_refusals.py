"""``estimate`` and ``plan`` refuse what they cannot estimate, or what ``fit`` refuses, in one paragraph (exit
status 2, no traceback) that names the bad value and the fix, before the estimate runs (audit 64b)."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch

from pl_lowprec.cli import main

pytest.importorskip("peft")
pytest.importorskip("bitsandbytes")

QUICKSTART = str(Path(__file__).resolve().parents[2] / "configs/quickstart.yaml")


def refusal(capsys, *args: str) -> str:
    """``main(args)`` exits with status 2 and one error paragraph, no traceback; that paragraph."""
    with pytest.raises(SystemExit) as exited:
        main(list(args))
    text = "".join(capsys.readouterr())
    assert exited.value.code == 2, text[-3000:]
    assert "Traceback" not in text, text[-3000:]
    errors = [line for line in text.splitlines() if "error: " in line]
    assert len(errors) == 1, text
    return errors[0]


@pytest.fixture
def no_estimate(monkeypatch):
    """The estimate fails the test: every refusal here must come before it."""

    def estimates(*args, **kwargs):
        raise AssertionError("the estimate ran before the refusal")

    monkeypatch.setattr("pl_lowprec.cli.estimate.estimate_memory", estimates)
    monkeypatch.setattr("pl_lowprec.cli.plan.plan_memory", estimates)


@pytest.mark.parametrize("command", [["estimate"], ["plan", "--memory", "8GiB"]])
def test_precision_auto_for_cuda_without_a_gpu_names_gpu_as_the_fix(capsys, monkeypatch, no_estimate, command):
    """It ended in ``AssertionError: Torch not compiled with CUDA enabled`` (finding 5)."""
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    error = refusal(capsys, *command, "--config", QUICKSTART, "--trainer.accelerator=gpu")
    assert "precision='auto' on CUDA" in error and "no GPU" in error
    assert "--gpu NAME" in error and "H100, H200, A100, L4, RTX4090, T4" in error


def test_estimate_memory_refuses_auto_for_cuda_without_a_gpu_and_names_time_on(monkeypatch):
    from pl_lowprec import estimate_memory
    from pl_lowprec.demo import TinyLlama

    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    build = functools.partial(TinyLlama, hidden_size=64, num_layers=2)
    with pytest.raises(ValueError, match=r"precision='auto' on CUDA .* time_on='NAME'"):
        estimate_memory(build, {"input_ids": torch.zeros(2, 64, dtype=torch.long)}, device="cuda", precision="auto")


@pytest.mark.parametrize("command", [["estimate"], ["plan", "--memory", "8GiB"]])
@pytest.mark.parametrize(
    ("option", "said"),
    [
        ("--trainer.accumulate_grad_batches=0", "Trainer(accumulate_grad_batches=0) must be an integer >= 1"),
        ("--trainer.num_nodes=0", "`num_nodes` must be a positive integer, but got 0."),
    ],
)
def test_zero_accumulation_or_nodes_is_refused_as_fit_refuses_it(capsys, no_estimate, command, option, said):
    """Both were read as 1 and estimated (finding 10); fit refuses them, in these words."""
    assert said in refusal(capsys, *command, "--config", QUICKSTART, option)
