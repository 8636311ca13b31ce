"""TextDataModule(packing=True) checks, on the first packed batches of a fit, that the module keeps samples apart.

The user's module wraps a real ``LlamaForCausalLM`` (SDPA, config ``use_cache=True`` as most hub models), so the
leaks are transformers' own: a cache or an attention_mask turns the block-causal mask off.
"""

import pytest
import torch
from loading_helpers import save_pretrained_dir
from packing_helpers import ForwardCounter, HFUser, prompt_completion_file, quiet_trainer

from pl_lowprec.data import TextDataModule
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
        max_steps=4, num_sanity_val_steps=1, val_check_interval=2, limit_val_batches=2, callbacks=[counter]
    )
    data = _data(pretrained, records, batch_size=2, val_fraction=0.4)
    trainer.fit(make(pretrained), datamodule=data)
    assert counter.train_batches == 4 and counter.val_batches >= 3  # the sanity check's and two validations
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
