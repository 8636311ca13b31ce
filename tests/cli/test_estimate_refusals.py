"""``estimate`` and ``plan`` refuse what they cannot estimate, or what ``fit`` refuses, in one paragraph (exit
status 2, no traceback) that names the bad value and the fix, before the estimate runs (audit 64b)."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch
from gguf_helpers import fail_if_called, refusal_line

pytest.importorskip("peft")
pytest.importorskip("bitsandbytes")

QUICKSTART = str(Path(__file__).resolve().parents[2] / "configs/quickstart.yaml")


def refusal(capsys, *args: str) -> str:
    """``main(args)`` exits with status 2 and one error paragraph, no traceback; that paragraph."""
    return refusal_line(capsys, list(args))


@pytest.fixture
def no_estimate(monkeypatch):
    """The estimate fails the test: every refusal here must come before it."""
    fail_if_called(
        monkeypatch, ["pl_lowprec.cli.estimate.estimate_memory", "pl_lowprec.cli.plan.plan_memory"], "the estimate ran"
    )


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


@pytest.mark.parametrize("size", [0.5, "0.5", "0.9 B", "0.0001KiB"])
def test_a_memory_size_under_one_byte_is_refused_with_the_forms_allowed(size):
    """They were a 0-byte budget, refused only after the whole plan search (finding 11)."""
    from pl_lowprec.memory.sizes import parse_bytes

    with pytest.raises(ValueError, match=r"is not a memory size: .*at least 1.* 24GiB, 80GB or 512MiB") as refused:
        parse_bytes(size, "memory_budget")
    assert f"memory_budget={size!r}" in str(refused.value)
    assert parse_bytes("1 B") == parse_bytes(1.5) == 1


def test_plan_memory_under_one_byte_is_refused_before_the_config_is_read(capsys, monkeypatch):
    monkeypatch.setattr("pl_lowprec.cli.plan.rebuild_classes", lambda *a: pytest.fail("the config was read"))
    error = refusal(capsys, "plan", "--config", QUICKSTART, "--memory", "0.5")
    assert "--memory='0.5' is not a memory size" in error and "512MiB" in error


@pytest.mark.parametrize("command", [["estimate"], ["plan", "--memory", "8GiB"]])
def test_an_empty_gpu_name_is_refused_before_the_config_is_read(capsys, monkeypatch, command):
    """``--gpu ''`` skipped the early check, so the unknown-GPU paragraph came after the data was read."""
    for module in ("estimate", "plan"):
        monkeypatch.setattr(f"pl_lowprec.cli.{module}.rebuild_classes", lambda *a: pytest.fail("the config was read"))
    error = refusal(capsys, *command, "--config", QUICKSTART, "--gpu", "")
    assert "No figures for a GPU named ''" in error and "--gpu H100" in error


def test_plot_into_a_missing_directory_is_refused_before_the_estimate(capsys, no_estimate, tmp_path):
    """It ran the whole estimate, then failed with a raw ``[Errno 2]`` (finding 12)."""
    pytest.importorskip("matplotlib")
    missing = tmp_path / "no_such_dir" / "step.png"
    error = refusal(capsys, "estimate", "--config", QUICKSTART, "--plot", str(missing))
    assert f"the directory {str(missing.parent)!r} does not exist" in error
    assert "Create it" in error and "Errno" not in error
