"""A run given ``pathlib.Path`` arguments (``TextDataModule(train_files=Path(...))``, ``CausalLM(Path(...))``, as
Python users write them) saved them as ``PosixPath`` in the checkpoint's hyperparameters, and torch >= 2.6 loads
checkpoints with ``weights_only=True`` by default, which refuses that class: ``Trainer.fit(ckpt_path=...)``,
``load_from_checkpoint`` and the package's own readers (``pl-lowprec fit --ckpt_path``) failed with an
``UnpicklingError``. Paths are saved as strings."""

import pickle
from pathlib import Path

import pytest
import torch
from lightning.pytorch.strategies import SingleDeviceStrategy
from lightning_helpers import Classifier, classification_loader, quiet_trainer
from loading_helpers import save_pretrained_dir, write_prompt_completion

from pl_lowprec import LowPrecisionFSDPStrategy
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


class OwnModule(Classifier):
    """A user's own module that saves a ``Path`` argument among its hyperparameters, as Lightning lets it."""

    def __init__(self, data_dir: Path) -> None:
        super().__init__(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2)))
        self.save_hyperparameters()


STRATEGIES = {"lowprec": lambda: "lowprec", "lowprec_fsdp": lambda: LowPrecisionFSDPStrategy(shard_modules=["Linear"])}


@pytest.mark.usefixtures("no_process_group_left")  # lowprec_fsdp's fit starts a one-process group
@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_a_checkpoint_holding_paths_resumes_under_the_strategies(tmp_path, strategy):
    """A file that holds a ``PosixPath`` (a user's own module, or written before paths were saved as strings) is
    read by the strategy and by ``pl-lowprec``'s own reader with the path classes allowed; Lightning's own strategy
    refuses it under torch's ``weights_only=True``."""
    checkpoint = tmp_path / "step2.ckpt"
    trainer = quiet_trainer(strategy=STRATEGIES[strategy](), max_steps=2)
    trainer.fit(OwnModule(tmp_path), classification_loader())
    trainer.save_checkpoint(checkpoint)
    with pytest.raises(pickle.UnpicklingError, match="PosixPath"):
        torch.load(checkpoint, weights_only=True)

    resumed = quiet_trainer(strategy=STRATEGIES[strategy](), max_steps=4)
    resumed.fit(OwnModule(tmp_path), classification_loader(), ckpt_path=checkpoint)
    assert resumed.global_step == 4
    assert finished_run_line(checkpoint, max_steps=2) is not None  # the CLI's own reader
