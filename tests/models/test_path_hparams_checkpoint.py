"""A run given ``pathlib.Path`` arguments (``TextDataModule(train_files=Path(...))``, ``CausalLM(Path(...))``, as
Python users write them) saved them as ``PosixPath`` in the checkpoint's hyperparameters, and torch >= 2.6 loads
checkpoints with ``weights_only=True`` by default, which refuses that class: ``Trainer.fit(ckpt_path=...)``,
``load_from_checkpoint`` and the package's own readers (``pl-lowprec fit --ckpt_path``) failed with an
``UnpicklingError``. Paths are saved as strings."""

import pytest
import torch
from lightning.pytorch.strategies import SingleDeviceStrategy
from lightning_helpers import quiet_trainer
from loading_helpers import save_pretrained_dir, write_prompt_completion

from pl_lowprec.cli.resume import finished_run_line
from pl_lowprec.data import TextDataModule
from pl_lowprec.models import CausalLM

pytest.importorskip("transformers")


def _run(pretrained, data_file, ckpt_path=None, max_steps=1):
    data = TextDataModule(train_files=data_file, tokenizer=pretrained, batch_size=4, val_fraction=0)
    model = CausalLM(pretrained, lr=1e-2, warmup_steps=0)
    trainer = quiet_trainer(strategy=SingleDeviceStrategy(torch.device("cpu")), max_steps=max_steps)
    trainer.fit(model, datamodule=data, ckpt_path=ckpt_path)
    return trainer


def test_a_run_given_paths_resumes_and_loads_with_weights_only(tmp_path):
    pretrained = save_pretrained_dir(tmp_path / "pretrained", hidden_size=32, layers=1)
    data_file = write_prompt_completion(tmp_path / "pc.jsonl", n=8)
    checkpoint = tmp_path / "step1.ckpt"
    _run(pretrained, data_file).save_checkpoint(checkpoint)

    assert _run(pretrained, data_file, ckpt_path=checkpoint, max_steps=2).global_step == 2  # Trainer.fit(ckpt_path)

    saved = torch.load(checkpoint, weights_only=True, map_location="cpu")  # torch's default since 2.6
    assert saved["hyper_parameters"]["pretrained"] == str(pretrained)
    assert saved["datamodule_hyper_parameters"]["train_files"] == str(data_file)
    assert saved["datamodule_hyper_parameters"]["tokenizer"] == str(pretrained)

    assert (
        TextDataModule.load_from_checkpoint(checkpoint).train_sources
        == TextDataModule(train_files=data_file, tokenizer=pretrained).train_sources
    )
    assert CausalLM.load_from_checkpoint(checkpoint).hparams.pretrained == str(pretrained)
    assert finished_run_line(checkpoint, max_steps=1) is not None  # the CLI's own reader
