"""The same behaviour on a CUDA GPU (skipped without one; CI has none).

Each CUDA test compares with a reference: the plain PyTorch AMP loop on the GPU, or the same run on the CPU. The
helpers run on the CPU as well (the tests without the ``cuda`` marker), so the comparison itself is checked on every
machine and only the device changes on a GPU.
"""

import copy

import lightning.pytorch as pl
import pytest
import torch
from lightning_helpers import Classifier, StepRecorder, quiet_trainer
from plain_amp_loop import make_classification_data, make_mlp, train_plain_loop
from qlora_helpers import LossRecorder, frozen_state, ids_loader, tiny_llama

from pl_lowprec import AMPPrecision, LowPrecisionStrategy

ON_GPU = pytest.param("gpu", marks=pytest.mark.cuda)
QLORA_STEPS = 5


@pytest.mark.parametrize("accelerator", ["cpu", ON_GPU])
def test_fp16_matches_the_plain_loop(accelerator):
    device = "cuda" if accelerator == "gpu" else "cpu"
    loader = torch.utils.data.DataLoader(make_classification_data(n=20 * 4 * 8), batch_size=8)
    reference = make_mlp().to(device)
    model = copy.deepcopy(reference)
    opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    train_plain_loop(reference, loader, opt, precision="16-mixed", accumulate=4, clip=1.0, device=device)
    plugin = AMPPrecision("16-mixed")
    trainer = quiet_trainer(
        accelerator=accelerator, plugins=[plugin], max_epochs=1, accumulate_grad_batches=4, gradient_clip_val=1.0
    )
    trainer.fit(Classifier(model), loader)
    assert plugin.device == device and trainer.strategy.root_device.type == device
    assert plugin._tracker.optimizer_steps == 20 and plugin.loss_scale_state().skipped_steps == 0
    for ours, theirs in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(ours.to(device), theirs)  # Lightning's teardown moved the model back to the CPU


@pytest.mark.parametrize("accelerator", ["cpu", ON_GPU])
def test_forced_overflow_skips_the_step_and_halves_the_scale(accelerator):
    plugin, recorder = AMPPrecision("16-mixed"), StepRecorder()
    module = Classifier(make_mlp(), overflow_at_steps=(1,))  # inf in a gradient after the 2nd step's backward
    loader = torch.utils.data.DataLoader(make_classification_data(n=4 * 8), batch_size=8)
    trainer = quiet_trainer(accelerator=accelerator, plugins=[plugin], max_steps=4, callbacks=[recorder])
    trainer.fit(module, loader)

    assert plugin.device == ("cuda" if accelerator == "gpu" else "cpu")
    for name, before in recorder.params[1].items():
        torch.testing.assert_close(recorder.params[2][name], before, rtol=0, atol=0, msg=name)  # skipped
    for k in (1, 3, 4):  # every other step moved the weights
        assert not torch.equal(recorder.params[k]["model.0.weight"], recorder.params[k - 1]["model.0.weight"])
    state = plugin.loss_scale_state()
    assert (state.scale, state.overflows, state.skipped_steps) == (2.0**15, 1, 1)
    assert plugin._tracker.optimizer_steps == trainer.global_step == 4


class _BaseLayers(pl.Callback):
    """Reads the quantized base layers during training (teardown moves the model back to the CPU)."""

    def __init__(self) -> None:
        self.devices: set[str] = set()
        self.kinds: set[tuple[str, str, bool]] = set()
        self.frozen_at_start: dict[str, torch.Tensor] = {}

    def on_train_start(self, trainer, pl_module) -> None:
        self.frozen_at_start = frozen_state(pl_module)  # quantized weights and statistics, on the device

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        for module in pl_module.modules():
            if hasattr(module, "base_layer"):
                weight = module.base_layer.weight
                self.devices.add(weight.device.type)
                self.kinds.add((type(module.base_layer).__name__, weight.quant_type, weight.compress_statistics))


def _qlora_run(accelerator: str, plugins: list, precision: str | None = None) -> dict:
    """``QLORA_STEPS`` steps of nf4-dq QLoRA on a tiny Llama: the losses, the base layers seen, the frozen state."""
    losses, layers = LossRecorder(), _BaseLayers()
    strategy = LowPrecisionStrategy(
        quantization="nf4-dq", lora={"r": 8, "lora_alpha": 16}, activation_checkpointing="LlamaDecoderLayer"
    )
    model = tiny_llama(lr=1e-2)
    trainer = quiet_trainer(
        accelerator=accelerator,
        strategy=strategy,
        plugins=plugins,
        precision=precision,
        max_steps=QLORA_STEPS,
        callbacks=[losses, layers],
    )
    trainer.fit(model, ids_loader())
    return {"losses": torch.tensor(losses.losses), "layers": layers, "model": model, "trainer": trainer}


def _assert_qlora_trained(run: dict, device: str) -> None:
    assert run["trainer"].strategy.root_device.type == device
    assert run["layers"].devices == {device}
    assert run["layers"].kinds == {("Linear4bit", "nf4", True)}  # nf4-dq: 4-bit NF4, double-quantized statistics
    losses = run["losses"]
    assert len(losses) == QLORA_STEPS and losses[-1] < losses[0] - 0.2  # measured on the CPU: 5.58 -> 5.12
    after = frozen_state(run["model"])
    assert len(after) == len(run["layers"].frozen_at_start) > 0
    for key, before in run["layers"].frozen_at_start.items():  # only the adapters trained
        torch.testing.assert_close(after[key].cpu(), before.cpu(), rtol=0, atol=0, msg=key)


def test_qlora_on_cpu_in_fp32_is_the_reference():
    """The reference of the CUDA test, checked here: the adapters learn and the quantized base stays as it was."""
    pytest.importorskip("bitsandbytes")
    torch.manual_seed(0)
    run = _qlora_run("cpu", [], "32-true")
    _assert_qlora_trained(run, "cpu")


@pytest.mark.cuda
def test_qlora_fp16_on_cuda_trains_like_fp32_on_the_cpu():
    pytest.importorskip("bitsandbytes")
    torch.manual_seed(0)
    reference = _qlora_run("cpu", [], "32-true")
    plugin = AMPPrecision("16-mixed")
    torch.manual_seed(0)
    run = _qlora_run("gpu", [plugin])
    _assert_qlora_trained(run, "cuda")
    # The same adapters, base weights and batches: every step's loss within fp16 rounding of fp32. Measured on the
    # CPU (fp16 autocast there): 1e-4 from fp32; one step of learning moves the loss by 0.07 or more.
    torch.testing.assert_close(run["losses"], reference["losses"], rtol=0, atol=0.02)
    # The scaler was live on the GPU and every step was applied: none overflowed at 2**16 (none on the CPU either).
    state = plugin.loss_scale_state()
    assert plugin.device == "cuda" and plugin.scaler is not None
    assert (state.scale, state.skipped_steps) == (2.0**16, 0)
    assert plugin._tracker.optimizer_steps == QLORA_STEPS
