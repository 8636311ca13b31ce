"""LowPrecisionStrategy: activation checkpointing by configuration, in the right place in the Trainer."""

import lightning.pytorch as pl
import pytest
import torch
import warm_python  # noqa: F401 - its forkserver preload: the spawned ranks start warm
from lightning.pytorch.cli import LightningCLI
from lightning_helpers import Classifier, quiet_trainer
from torch import nn

from pl_lowprec import AMPPrecision, LowPrecisionDDPStrategy, LowPrecisionStrategy
from pl_lowprec.demo.tiny_gpt import Block, TinyGPT
from pl_lowprec.transforms.checkpointing import CheckpointedForward, is_checkpointed


def _loader(batches=6):
    ids = torch.randint(0, 256, (batches * 4, 33), generator=torch.Generator().manual_seed(0))
    dataset = [{"input_ids": row} for row in ids]
    return torch.utils.data.DataLoader(dataset, batch_size=4)


class GradRecorder(pl.Callback):
    def __init__(self):
        self.grads = []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self.grads.append({n: p.grad.clone() for n, p in pl_module.named_parameters()})


def _gpt(layers=4):
    torch.manual_seed(0)
    return TinyGPT(dim=32, layers=layers, heads=2, max_len=64, warmup_steps=1)


def _fit(strategy, plugins=(), steps=4, model=None):
    recorder = GradRecorder()
    model = model or _gpt()
    trainer = quiet_trainer(strategy=strategy, plugins=list(plugins), max_steps=steps, callbacks=[recorder])
    trainer.fit(model, _loader())
    return model, recorder.grads


@pytest.mark.parametrize("precision", [None, "bf16-mixed"])
def test_gradients_identical_with_and_without_checkpointing(precision):
    plugins = lambda: [AMPPrecision(precision)] if precision else []  # noqa: E731
    _, expected = _fit("auto", plugins())
    model, actual = _fit(LowPrecisionStrategy(activation_checkpointing=["Block"]), plugins())
    assert all(is_checkpointed(b) for b in model.blocks)
    assert len(actual) == len(expected) == 4
    for step_expected, step_actual in zip(expected, actual, strict=True):
        for name, grad in step_expected.items():
            torch.testing.assert_close(step_actual[name], grad)


def test_registry_name_works():
    model, _ = _fit("lowprec", steps=1)
    assert not any(is_checkpointed(m) for m in model.modules())  # no policy: nothing checkpointed


def test_every_n_checkpoints_every_other_block():
    model, _ = _fit(LowPrecisionStrategy(activation_checkpointing=Block, checkpoint_every_n=2), steps=1)
    assert [is_checkpointed(b) for b in model.blocks] == [True, False, True, False]


def test_fit_twice_and_validate_after_fit_wrap_once():
    strategy = LowPrecisionStrategy(activation_checkpointing={Block})
    model = _gpt()
    trainer = quiet_trainer(strategy=strategy, max_steps=1)
    trainer.fit(model, _loader())
    trainer.fit_loop.epoch_loop.max_steps = 2
    trainer.fit(model, _loader())
    trainer.validate(model, _loader(1))
    for block in model.blocks:
        assert isinstance(block.forward, CheckpointedForward)
        assert not isinstance(block.forward.forward, CheckpointedForward)


class BuiltInConfigureModel(TinyGPT):
    """Builds its blocks in ``configure_model``: the transform must come after it."""

    def __init__(self):
        super().__init__(dim=32, layers=1, heads=2, max_len=64)
        self.blocks = nn.ModuleList()  # built in configure_model

    def configure_model(self):
        if len(self.blocks) == 0:
            self.blocks.extend(Block(32, 2) for _ in range(2))


def test_transform_runs_after_configure_model():
    model, grads = _fit(LowPrecisionStrategy(activation_checkpointing="Block"), model=BuiltInConfigureModel(), steps=1)
    assert len(model.blocks) == 2 and all(is_checkpointed(b) for b in model.blocks)
    assert "blocks.1.mlp.0.weight" in grads[0]


def test_unknown_class_fails_before_training():
    trainer = quiet_trainer(strategy=LowPrecisionStrategy(activation_checkpointing="LlamaDecoderLayer"), max_steps=1)
    with pytest.raises(ValueError, match=r"'LlamaDecoderLayer' matches no module of TinyGPT.*Block"):
        trainer.fit(_gpt(), _loader())
    assert trainer.global_step == 0


@pytest.mark.parametrize("bad", [0, "2"])
def test_invalid_every_n_fails_at_construction(bad):
    with pytest.raises(ValueError, match=rf"checkpoint_every_n={bad!r} is not valid"):
        LowPrecisionStrategy(activation_checkpointing="Block", checkpoint_every_n=bad)


def test_state_dict_keys_same_and_checkpoint_resumes_without_checkpointing(tmp_path):
    plain_keys = list(_gpt().state_dict())
    model = _gpt()
    trainer = quiet_trainer(strategy=LowPrecisionStrategy(activation_checkpointing="Block"), max_steps=2)
    trainer.fit(model, _loader())
    assert list(model.state_dict()) == plain_keys
    ckpt = tmp_path / "ckpt.ckpt"
    trainer.save_checkpoint(ckpt)

    # resume the checkpointed run's checkpoint without checkpointing, and a plain one with it
    resumed = _gpt()
    quiet_trainer(strategy="lowprec", max_steps=3).fit(resumed, _loader(), ckpt_path=ckpt)
    assert not any(is_checkpointed(m) for m in resumed.modules())
    plain_trainer = quiet_trainer(max_steps=2)
    plain_trainer.fit(_gpt(), _loader())
    plain_trainer.save_checkpoint(tmp_path / "plain.ckpt")
    again = _gpt()
    trainer = quiet_trainer(strategy=LowPrecisionStrategy(activation_checkpointing="Block"), max_steps=3)
    trainer.fit(again, _loader(), ckpt_path=tmp_path / "plain.ckpt")
    assert trainer.global_step == 3 and all(is_checkpointed(b) for b in again.blocks)


class CLIGPT(TinyGPT):
    def __init__(self):
        super().__init__(dim=32, layers=2, heads=2, max_len=64)

    def train_dataloader(self):
        return _loader(2)


def test_yaml_class_path(tmp_path):
    config = tmp_path / "ckpt.yaml"
    config.write_text(
        """
trainer:
  accelerator: cpu
  max_steps: 1
  logger: false
  enable_checkpointing: false
  strategy:
    class_path: pl_lowprec.LowPrecisionStrategy
    init_args:
      activation_checkpointing: [Block]
      checkpoint_every_n: 2
      checkpoint_impl: reentrant
"""
    )
    cli = LightningCLI(CLIGPT, args=["fit", "--config", str(config)], save_config_callback=None)
    assert isinstance(cli.trainer.strategy, LowPrecisionStrategy)
    assert [is_checkpointed(b) for b in cli.model.blocks] == [True, False]
    assert cli.model.blocks[0].forward.impl == "reentrant"
    assert cli.trainer.global_step == 1


def test_ddp_strategy_takes_ddp_arguments_from_yaml(tmp_path):
    config = tmp_path / "ddp.yaml"
    config.write_text(
        """
trainer:
  accelerator: cpu
  devices: 2
  logger: false
  strategy:
    class_path: LowPrecisionDDPStrategy
    init_args:
      activation_checkpointing: [Block]
      process_group_backend: gloo
      find_unused_parameters: true
      start_method: spawn
"""
    )
    cli = LightningCLI(CLIGPT, args=["--config", str(config)], run=False, save_config_callback=None)
    strategy = cli.trainer.strategy
    assert isinstance(strategy, LowPrecisionDDPStrategy)
    assert strategy.transform_config.activation_checkpointing == ["Block"]
    assert strategy._process_group_backend == "gloo" and strategy._start_method == "spawn"
    assert strategy._ddp_kwargs["find_unused_parameters"] is True  # forwarded to DistributedDataParallel


def test_ddp_registry_names():
    trainer = quiet_trainer(strategy="lowprec_ddp_spawn", devices=2)
    assert isinstance(trainer.strategy, LowPrecisionDDPStrategy) and trainer.strategy._start_method == "spawn"


@pytest.mark.slow
@pytest.mark.parametrize("quantization", [None, "nf4"])
def test_spawn_hands_the_trained_adapters_back_to_the_model_in_hand(tmp_path, quantization):
    """Lightning's spawn launcher loads rank 0's weights into the main process's module with strict=False; that
    module never had the LoRA layers, so the adapters were dropped and ``model`` stayed the untrained one."""
    from lightning.pytorch.callbacks import ModelCheckpoint
    from plain_amp_loop import make_classification_data, make_mlp

    model = Classifier(make_mlp(features=64, hidden=128))  # layers of 4,096+ weights, which bitsandbytes quantizes
    lora = {"r": 4, "target_modules": ["0", "3"]}
    # forkserver: the spawn launcher's path (the trainer pickled to each rank, rank 0's weights loaded back here),
    # its ranks forked from the warm server (tests/warm_python.py) instead of importing torch again each
    strategy = LowPrecisionDDPStrategy(start_method="forkserver", lora=lora, quantization=quantization)
    saved = ModelCheckpoint(dirpath=tmp_path, save_last=True)
    trainer = quiet_trainer(
        strategy=strategy,
        devices=2,
        max_steps=3,
        callbacks=[saved],
        enable_checkpointing=True,
        use_distributed_sampler=False,
    )
    trainer.fit(model, torch.utils.data.DataLoader(make_classification_data(n=48, features=64), batch_size=8))
    adapters = {name: p for name, p in model.named_parameters() if "lora_" in name}
    assert len(adapters) == 4 and all(p.abs().sum() > 0 for n, p in adapters.items() if "lora_B" in n)  # trained
    on_rank_0 = torch.load(tmp_path / "last.ckpt", weights_only=False)["state_dict"]
    for name, weight in adapters.items():
        assert torch.equal(weight, on_rank_0[name]), name
    if quantization:
        assert type(model.model[0].base_layer).__name__ == "Linear4bit"


@pytest.mark.slow
def test_a_spawn_fit_hands_back_what_one_device_trains():
    """``start_method="spawn"`` itself (the other spawn tests fork their ranks from the warm forkserver): fresh
    interpreters unpickle the strategy and trainer; rank 0's weights and the logged loss come back into this
    process, as Lightning's spawn launcher hands them back. Both ranks read every batch, so 2 steps equal one
    device's (measured: the same weights in hand as under DDPStrategy(start_method="spawn"))."""
    runs = {}
    for name, strategy, devices in (
        ("one device", "auto", 1),
        ("spawn", LowPrecisionDDPStrategy(start_method="spawn", process_group_backend="gloo"), 2),
    ):
        model = _gpt(layers=1)
        trainer = quiet_trainer(
            strategy=strategy, devices=devices, max_steps=2, limit_val_batches=0, use_distributed_sampler=False
        )
        trainer.fit(model, _loader(batches=2))
        runs[name] = model.state_dict(), dict(trainer.callback_metrics), trainer.state.finished
    (weights, metrics, finished), (expected, expected_metrics, _) = runs["spawn"], runs["one device"]
    assert finished and metrics.keys() == expected_metrics.keys() == {"train/loss"}
    torch.testing.assert_close(metrics["train/loss"], expected_metrics["train/loss"])
    assert weights.keys() == expected.keys()
    for key, weight in expected.items():  # atol: AdamW turns the key bias's round-off gradient into updates of
        # up to 3e-5 (softmax ignores that bias); an update is 3e-3 a step, the untrained weights 6e-3 away
        torch.testing.assert_close(weights[key], weight, rtol=1e-4, atol=1e-4, msg=key)
    untrained = _gpt(layers=1).state_dict()
    assert not torch.equal(weights["head.weight"], untrained["head.weight"])  # trained, not the model as it was


def test_spawn_warns_where_the_model_in_hand_cannot_take_the_trained_weights(tmp_path, monkeypatch):
    """fp8 or offloading cannot be applied on the main process's CPU: the model in hand stays untrained, and a warning
    says so and where the weights are, instead of Lightning's silent partial load."""
    import io

    from lightning.pytorch.strategies.launchers.multiprocessing import _WorkerOutput
    from plain_amp_loop import make_mlp

    strategy = LowPrecisionDDPStrategy(start_method="spawn", lora={"r": 4, "target_modules": ["0", "3"]})
    trainer = quiet_trainer(strategy=strategy, devices=2)
    model = Classifier(make_mlp())
    strategy.connect(model)
    untrained = {k: v.clone() for k, v in model.state_dict().items()}
    (weights := tmp_path / "rank0.ckpt").write_bytes(b"")
    torch.save({"model.0.lora_A.default.weight": torch.ones(4, 32)}, weights)

    def needs_cuda(*args, **kwargs):
        raise ValueError("fp8 needs a CUDA device")

    monkeypatch.setattr(strategy.transform, "apply", needs_cuda)
    metrics = io.BytesIO()
    torch.save({}, metrics)
    output = _WorkerOutput(None, str(weights), trainer.state, None, {"callback_metrics_bytes": metrics.getvalue()})
    with pytest.warns(UserWarning, match=r"could not come back into the model in this process \(ValueError: fp8"):
        strategy._launcher._recover_results_in_main_process(output, trainer)
    assert all(torch.equal(v, untrained[k]) for k, v in model.state_dict().items())  # nothing half-loaded
    assert not weights.exists()  # the temporary file is removed, as Lightning removes it
