"""TextDataModule(packing=True) checks, on the first packed batches of a fit, that the module keeps samples apart.

The user's module wraps a real ``LlamaForCausalLM`` (SDPA, config ``use_cache=True`` as most hub models), so the
leaks are transformers' own: a cache or an attention_mask turns the block-causal mask off.
"""

import sys
from pathlib import Path

import pytest
import torch
import warm_python
from loading_helpers import save_pretrained_dir
from packing_helpers import ForwardCounter, HFUser, prompt_completion_file, quiet_trainer

from pl_lowprec.data import TextDataModule
from pl_lowprec.data.isolation_check import probe_row
from pl_lowprec.models import CausalLM

pytest.importorskip("transformers")

LEAKS = {
    "old advice": r"without use_cache=False, and the model's config has use_cache=True",
    "attention_mask": r"passes an attention_mask",
    "no position_ids": r"does not pass batch\['position_ids'\]",
}


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory):
    return save_pretrained_dir(tmp_path_factory.mktemp("pretrained"))


@pytest.fixture(scope="module")
def records(tmp_path_factory):
    return prompt_completion_file(tmp_path_factory.mktemp("data") / "pc.jsonl")


def _data(pretrained, records, packing=True, batch_size=16, val_fraction=0.0):
    return TextDataModule(
        str(records), str(pretrained), seq_len=64, batch_size=batch_size, val_fraction=val_fraction, packing=packing
    )


@pytest.mark.parametrize("call", list(LEAKS))
def test_a_module_that_lets_packed_samples_attend_to_each_other_is_stopped_before_step_1(pretrained, records, call):
    module = HFUser(str(pretrained), train_call=call)
    before = {k: v.clone() for k, v in module.state_dict().items()}
    trainer = quiet_trainer(max_steps=2)
    with pytest.raises(ValueError, match=LEAKS[call]) as stopped:
        trainer.fit(module, datamodule=_data(pretrained, records))
    message = str(stopped.value)
    assert message.startswith("TextDataModule(packing=True) stopped the run before HFUser.training_step ran")
    assert "pl_lowprec.models.forward_batch(self.model, batch, labels=batch['labels'])" in message
    assert "\n" not in message and "packing=False" in message
    assert trainer.global_step == 0 and module.steps_done == 0
    assert all(torch.equal(v, before[k]) for k, v in module.state_dict().items())


@pytest.mark.parametrize("call", ["use_cache=False", "forward_batch"])
def test_a_module_that_keeps_samples_apart_trains_as_on_the_samples_unpacked(pretrained, records, call):
    """One step on every sample, packed into rows, equals one step on them padded (the reference)."""

    def one_step(packing: bool, call: str) -> tuple[float, dict[str, torch.Tensor]]:
        module = HFUser(str(pretrained), train_call=call)
        trainer = quiet_trainer(max_steps=1)
        data = _data(pretrained, records, packing=packing)
        trainer.fit(module, datamodule=data)
        assert len(data.train_set) <= 16  # one batch: every sample
        return float(trainer.callback_metrics["train/loss"]), module.state_dict()

    loss, params = one_step(True, call)
    reference_loss, reference = one_step(False, "forward_batch")
    assert abs(loss - reference_loss) < 1e-5 * reference_loss
    for name, value in reference.items():
        torch.testing.assert_close(params[name], value, rtol=1e-4, atol=1e-6, msg=name)


def test_the_check_stops_a_leaking_validation_step_at_the_sanity_check(pretrained, records):
    module = HFUser(str(pretrained), train_call="forward_batch", val_call="old advice")
    trainer = quiet_trainer(max_steps=2, num_sanity_val_steps=1)
    data = _data(pretrained, records, batch_size=2, val_fraction=0.4)
    with pytest.raises(ValueError, match=r"before HFUser.validation_step ran.*config has use_cache=True"):
        trainer.fit(module, datamodule=data)
    assert trainer.global_step == 0 and module.steps_done == 0


class LossSumOldAdvice(CausalLM):
    """A CausalLM subclass whose own ``loss_sum`` calls the base model the old way (no ``use_cache=False``)."""

    def loss_sum(self, batch):
        hidden = self.model.base_model(input_ids=batch["input_ids"], position_ids=batch["position_ids"])
        head = self.model.get_output_embeddings()
        logits = head(hidden.last_hidden_state)[:, :-1]
        labels = batch["labels"][:, 1:]
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum")
        return loss, (labels != -100).sum()


class ForwardOverride(CausalLM):
    """A CausalLM subclass that overrides ``forward`` only: checked like any module (and it passes)."""

    def forward(self, input_ids, attention_mask=None, position_ids=None):
        return super().forward(input_ids, attention_mask, position_ids)


def test_a_causal_lm_subclass_with_its_own_loss_path_is_checked(pretrained, records):
    trainer = quiet_trainer(max_steps=1)
    with pytest.raises(ValueError, match=r"before LossSumOldAdvice.training_step ran.*LlamaModel without use_cache"):
        trainer.fit(LossSumOldAdvice(str(pretrained)), datamodule=_data(pretrained, records))
    assert trainer.global_step == 0


@pytest.mark.parametrize(
    ("make", "check_runs"),
    [
        pytest.param(lambda p: CausalLM(str(p)), 0, id="CausalLM"),
        pytest.param(lambda p: ForwardOverride(str(p)), 4, id="CausalLM-subclass"),
        pytest.param(lambda p: HFUser(str(p)), 4, id="own-module"),
    ],
)
def test_the_check_runs_once_per_fit_for_training_and_once_for_validation(pretrained, records, make, check_runs):
    """Two model calls for the first training batch and two for the first validation batch, then none; none for
    CausalLM itself, whose packed path is tested against unpacked batches (test_packed_equivalence.py)."""
    counter = ForwardCounter()
    trainer = quiet_trainer(
        max_steps=2, num_sanity_val_steps=1, val_check_interval=1, limit_val_batches=1, callbacks=[counter]
    )
    data = _data(pretrained, records, batch_size=2, val_fraction=0.4)
    trainer.fit(make(pretrained), datamodule=data)
    assert counter.train_batches == 2 and counter.val_batches == 3  # the sanity check's and two validations
    assert counter.forwards == counter.train_batches + counter.val_batches + check_runs
    assert set(data.packing_guard.results) == ({"training_step", "validation_step"} if check_runs else set())
    assert all(result.keeps_apart for result in data.packing_guard.results.values())


def test_a_model_that_ignores_restarting_positions_is_named_with_packing_false_as_the_fix(
    pretrained, records, monkeypatch
):
    """The module calls its model right (forward_batch); transformers is made to ignore the restarts."""
    from transformers import masking_utils

    monkeypatch.setattr(masking_utils, "find_packed_sequence_indices", lambda position_ids: None)
    with pytest.raises(ValueError, match=r"the model itself ignores restarting position_ids.*Set packing=False"):
        quiet_trainer(max_steps=1).fit(HFUser(str(pretrained)), datamodule=_data(pretrained, records))


def test_the_cli_stops_a_leaking_module_with_one_paragraph(pretrained, records, tmp_path, capsys):
    from pl_lowprec.cli import main

    args = [
        "fit",
        "--model=packing_helpers.HFUser",
        f"--model.pretrained={pretrained}",
        "--model.train_call=old advice",
        "--data=pl_lowprec.data.TextDataModule",
        f"--data.train_files={records}",
        f"--data.tokenizer={pretrained}",
        "--data.seq_len=64",
        "--data.val_fraction=0",
        "--data.packing=true",
        "--trainer.accelerator=cpu",
        "--trainer.max_steps=1",
        "--trainer.limit_val_batches=0",
        "--trainer.enable_progress_bar=false",
        f"--trainer.default_root_dir={tmp_path}",
    ]
    with pytest.raises(SystemExit) as exited:
        main(args)
    err = capsys.readouterr().err
    assert exited.value.code == 2 and "Traceback" not in err
    (paragraph,) = [line for line in err.splitlines() if line.startswith("error:")]
    assert "fit stopped before its first step: TextDataModule(packing=True) stopped the run" in paragraph
    assert "without use_cache=False" in paragraph and "--data.packing false" in paragraph


@pytest.mark.slow
@pytest.mark.parametrize(
    ("strategy", "call", "expected"),
    [
        ("ddp", "old advice", "stopped: TextDataModule(packing=True) stopped the run before HFUser.training_step"),
        ("fsdp", "forward_batch", "trained 2"),  # nf4 + LoRA, decoder layers sharded: the check's forwards gather
    ],
)
def test_processes_check_together_and_stop_together(pretrained, tmp_path_factory, strategy, call, expected):
    """2 gloo processes, each with its own packed rows: no hang, the same outcome on both."""
    records = prompt_completion_file(tmp_path_factory.mktemp("records") / "pc.jsonl", n=24)
    script = Path(__file__).parents[1] / "_scripts" / "packing_guard_ddp.py"
    out = tmp_path_factory.mktemp("out")
    command = [sys.executable, str(script), str(out), str(pretrained), str(records), call, strategy]
    run = warm_python.run(command, 300, ranks=2)
    outcomes = [out.joinpath(f"rank{rank}.txt").read_text() for rank in (0, 1)]
    assert all(o.startswith(expected) for o in outcomes), (outcomes, run.stderr[-3000:])


def _one_sample_per_row(pretrained, tmp_path) -> TextDataModule:
    """Equal samples in rows of their length: no row holds two, so this process has nothing to check."""
    records = tmp_path / "equal.jsonl"
    records.write_text('{"prompt": "def f(x):\\n    return", "completion": " x + 1"}\n' * 6)
    unpacked = TextDataModule(str(records), str(pretrained), val_fraction=0)
    unpacked.setup("fit")
    (length,) = {len(s["input_ids"]) for s in unpacked.train_set}
    return TextDataModule(str(records), str(pretrained), seq_len=length, batch_size=2, val_fraction=0, packing=True)


@pytest.mark.parametrize("other_process", ["has a row to check", "found a leak"])
def test_a_process_follows_the_others_decisions(pretrained, records, tmp_path, monkeypatch, other_process):
    """DDP/FSDP without processes: the strategy's all-reduce answers as another process would. A process with
    nothing to check still runs the check's two forwards with the others (FSDP gathers weights in them), and
    stops when another found a leak."""
    leak = other_process == "found a leak"
    data = _data(pretrained, records) if leak else _one_sample_per_row(pretrained, tmp_path)
    counter = ForwardCounter()
    trainer = quiet_trainer(max_steps=1, callbacks=[counter], limit_val_batches=0)
    answers = iter([True, leak])  # a row to check on some process; a leak on some process
    monkeypatch.setattr(trainer.strategy, "reduce_boolean_decision", lambda decision, all=True: next(answers))
    module = HFUser(str(pretrained))  # keeps samples apart
    if leak:
        with pytest.raises(ValueError, match=r"on another process, a sample's outputs moved"):
            trainer.fit(module, datamodule=data)
        assert module.steps_done == 0
    else:
        trainer.fit(module, datamodule=data)
        assert all(probe_row(batch) is None for batch in data.train_dataloader())  # nothing to check here
        assert counter.forwards == counter.train_batches + 2 and "training_step" in data.packing_guard.results


@pytest.mark.cuda
def test_on_cuda_in_bf16_an_isolated_module_passes_well_inside_the_tolerance_and_a_leak_stops(pretrained, records):
    """The tolerance (1e-3 of a position's output size) against CUDA's bf16 kernels: an isolated module's outputs
    must not move by anything near it, a leaking one is still stopped."""
    from pl_lowprec.data.isolation_check import TOLERANCE

    data = _data(pretrained, records)
    quiet_trainer(accelerator="gpu", devices=1, precision="bf16-mixed", max_steps=1).fit(
        HFUser(str(pretrained)), datamodule=data
    )
    result = data.packing_guard.results["training_step"]
    assert result.keeps_apart and result.change < TOLERANCE / 100
    trainer = quiet_trainer(accelerator="gpu", devices=1, precision="bf16-mixed", max_steps=1)
    with pytest.raises(ValueError, match=r"without use_cache=False"):
        trainer.fit(HFUser(str(pretrained), train_call="old advice"), datamodule=_data(pretrained, records))


class OwnTransferHook(HFUser):
    """A module with its own on_after_batch_transfer, which Lightning skips when the data module has one."""

    transferred = 0

    def on_after_batch_transfer(self, batch, dataloader_idx):
        self.transferred += 1
        return batch


@pytest.mark.parametrize("packing", [True, False])
def test_the_modules_own_on_after_batch_transfer_still_runs(pretrained, records, packing):
    module = OwnTransferHook(str(pretrained))
    trainer = quiet_trainer(max_steps=2, limit_val_batches=0)
    trainer.fit(module, datamodule=_data(pretrained, records, packing=packing, batch_size=2))
    assert module.transferred == 2
