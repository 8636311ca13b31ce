"""``lowprec_fsdp``: a fit resumed with ``ckpt_path=`` of a checkpoint holding every weight (no LoRA, or
``adapter_only_checkpoint=False``) reads no pretrained file and ends where the uninterrupted run ends (validate:
``test_restore_whole_checkpoint.py``). Lightning restores after the strategy's setup, which had streamed all of
``pretrained=`` into the shards before the checkpoint's load overwrote it; the strategy now restores before its
setup, as ``lowprec``/``lowprec_ddp`` do. One process here (a one-rank gloo group): the same strategy, restore order
and load as on several ranks, without spawning them."""

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

WHOLE_CHECKPOINT = {"lora": LORA, "adapter_only_checkpoint": False}


def _trainer(pretrained, **kwargs):
    strategy = LowPrecisionFSDPStrategy(pretrained=pretrained, shard_modules=["LlamaDecoderLayer"], **kwargs.pop("s"))
    return quiet_trainer(strategy=strategy, **kwargs)


def _model(trainer):
    with trainer.init_module(empty_init=True):
        return ValidatedLlama(hidden_size=64)


@pytest.mark.usefixtures("no_process_group_left")
def test_fsdp_resumed_fit_of_a_whole_checkpoint_reads_no_pretrained_file(tmp_path, monkeypatch):
    """A fit resumed from a whole checkpoint reads no pretrained file and ends where the uninterrupted run ends."""
    pretrained = save_llama(tmp_path / "base", hidden_size=64)
    s = WHOLE_CHECKPOINT
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
