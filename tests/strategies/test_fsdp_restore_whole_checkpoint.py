"""``lowprec_fsdp``: validate (and a resumed fit) with ``ckpt_path=`` of a checkpoint holding every weight (no LoRA,
or ``adapter_only_checkpoint=False``) read no pretrained file. Lightning restores after the strategy's setup, which
had streamed all of ``pretrained=`` into the shards before the checkpoint's load overwrote it; the strategy now
restores before its setup, as ``lowprec``/``lowprec_ddp`` do, and the transform gives the model empty storage that
the checkpoint fills (on several ranks, each rank's rows: ``Sharding.placement``). One process here (a one-rank
gloo group): the same strategy, restore order and load as on several ranks, without spawning them."""

from __future__ import annotations

import pytest
import torch
from lightning_helpers import quiet_trainer
from loading_helpers import LLAMA_LORA as LORA
from loading_helpers import ValidatedLlama, count_safetensors_opens, save_llama
from qlora_helpers import ids_loader

from pl_lowprec import LowPrecisionFSDPStrategy

pytest.importorskip("transformers")
pytest.importorskip("peft")

STRATEGIES = {"whole-model": {}, "lora-whole-checkpoint": {"lora": LORA, "adapter_only_checkpoint": False}}


def _trainer(pretrained, **kwargs):
    strategy = LowPrecisionFSDPStrategy(pretrained=pretrained, shard_modules=["LlamaDecoderLayer"], **kwargs.pop("s"))
    return quiet_trainer(strategy=strategy, **kwargs)


def _model(trainer):
    with trainer.init_module(empty_init=True):
        return ValidatedLlama(hidden_size=64)


@pytest.mark.usefixtures("no_process_group_left")
@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_fsdp_validate_of_a_whole_checkpoint_reads_no_pretrained_file(tmp_path, monkeypatch, strategy):
    pretrained = save_llama(tmp_path / "base", hidden_size=64)
    trainer = _trainer(pretrained, s=STRATEGIES[strategy], max_steps=2)
    model = _model(trainer)
    trainer.fit(model, ids_loader(batches=2))
    checkpoint = tmp_path / "trained.ckpt"
    trainer.save_checkpoint(checkpoint)
    (trained,) = trainer.validate(model, ids_loader(batches=2, seed=1), verbose=False)

    opened = count_safetensors_opens(monkeypatch, pretrained)
    trainer = _trainer(pretrained, s=STRATEGIES[strategy])
    (restored,) = trainer.validate(_model(trainer), ids_loader(batches=2, seed=1), ckpt_path=checkpoint, verbose=False)
    assert opened == []  # 23 before: the headers, then once per module (22)
    assert restored == trained


@pytest.mark.usefixtures("no_process_group_left")
def test_fsdp_resumed_fit_of_a_whole_checkpoint_reads_no_pretrained_file(tmp_path, monkeypatch):
    """A fit resumed from a whole checkpoint reads no pretrained file and ends where the uninterrupted run ends."""
    pretrained = save_llama(tmp_path / "base", hidden_size=64)
    s = STRATEGIES["lora-whole-checkpoint"]
    torch.manual_seed(0)
    whole = _trainer(pretrained, s=s, max_steps=4)
    uninterrupted = _model(whole)
    whole.fit(uninterrupted, ids_loader(batches=2))

    torch.manual_seed(0)
    first = _trainer(pretrained, s=s, max_steps=2)
    first.fit(_model(first), ids_loader(batches=2))
    checkpoint = tmp_path / "step2.ckpt"
    first.save_checkpoint(checkpoint)

    opened = count_safetensors_opens(monkeypatch, pretrained)
    resumed_trainer = _trainer(pretrained, s=s, max_steps=4)
    resumed = _model(resumed_trainer)
    resumed_trainer.fit(resumed, ids_loader(batches=2), ckpt_path=checkpoint)
    assert opened == []  # 23 before
    for (name, value), expected in zip(resumed.state_dict().items(), uninterrupted.state_dict().values(), strict=True):
        torch.testing.assert_close(value, expected, rtol=0, atol=0, msg=name)
