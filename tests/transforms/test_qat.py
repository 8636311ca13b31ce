"""Quantization-aware training: fake quantization during fit, real torchao quantized weights at the end, whose
outputs equal the fake-quantized ones; exact resume; with LoRA; each bad input refused before training."""

import copy

import lightning.pytorch as pl
import pytest
import torch
from lightning_helpers import quiet_trainer

from pl_lowprec import LowPrecisionStrategy
from pl_lowprec.demo.tiny_gpt import TinyGPT
from pl_lowprec.transforms.qat import QATConfig, is_converted, is_fake_quantized, merge_lora, save_quantized

pytest.importorskip("torchao")


def _gpt():
    torch.manual_seed(0)
    return TinyGPT(dim=64, layers=2, heads=2, max_len=64, warmup_steps=1)


def _ids(seed=0, rows=8):
    return torch.randint(0, 256, (rows, 33), generator=torch.Generator().manual_seed(seed))


def _loader(batches=4):
    return torch.utils.data.DataLoader([{"input_ids": r} for r in _ids(rows=batches * 4)], batch_size=4)


class FakeQuantizedOutputs(pl.Callback):
    """Records the model's logits at the end of training, before the strategy converts it (callbacks run first).
    With LoRA, on a copy whose adapters are merged into the (still fake-quantized) base weights."""

    def on_train_end(self, trainer, pl_module):
        model = copy.deepcopy(pl_module)
        merge_lora(model)
        self.layers = [n for n, m in pl_module.named_modules() if is_fake_quantized(m)]
        with torch.no_grad():
            self.logits = model(_ids(seed=1)[:, :-1])


@pytest.mark.parametrize("scheme", ["int8-dynamic-int4-weight", "int4-weight-only", "int8-weight-only"])
def test_converted_model_holds_quantized_weights_matching_the_fake_quantized_outputs(scheme):
    from torchao.utils import TorchAOBaseTensor

    model, recorder = _gpt(), FakeQuantizedOutputs()
    trainer = quiet_trainer(strategy=LowPrecisionStrategy(qat=scheme), max_steps=3, callbacks=[recorder])
    trainer.fit(model, _loader())

    assert recorder.layers == [f"blocks.{i}.mlp.{j}" for i in range(2) for j in (0, 2)]  # not MHA's, not the head
    for name in recorder.layers:
        layer = model.get_submodule(name)
        weight = layer.weight
        assert isinstance(weight, TorchAOBaseTensor) and weight.qdata.dtype == torch.int8
        low, high = (-8, 7) if "int4" in scheme else (-128, 127)
        assert low <= weight.qdata.min() and weight.qdata.max() <= high
        assert weight.scale.shape == (layer.out_features, layer.in_features // 32)  # one scale per group of 32
    assert type(model.head.weight) is torch.nn.Parameter
    with torch.no_grad():
        logits = model(_ids(seed=1)[:, :-1])
    # The quantized kernels compute what fake quantization simulated: equal up to float summation order.
    torch.testing.assert_close(logits, recorder.logits, rtol=1e-5, atol=1e-5)


def test_qat_moves_the_weights_toward_the_int4_grid():
    """The loss falls under fake quantization (gradients pass through the rounding) on a batch seen repeatedly."""
    losses = []

    class Losses(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            losses.append(outputs["loss"].item())

    batch = [{"input_ids": r} for r in _ids(rows=4)] * 12
    trainer = quiet_trainer(
        strategy=LowPrecisionStrategy(qat=QATConfig("int8-dynamic-int4-weight", convert_on_fit_end=False)),
        max_steps=12,
        callbacks=[Losses()],
    )
    model = _gpt()
    trainer.fit(model, torch.utils.data.DataLoader(batch, batch_size=4))
    assert losses[-1] < 0.8 * losses[0]
    assert not is_converted(model) and any(is_fake_quantized(m) for m in model.modules())


@pytest.mark.parametrize("lora", [None, {"r": 4, "lora_alpha": 8}], ids=["full", "lora"])
def test_checkpoint_written_during_qat_resumes_exactly(tmp_path, lora):
    qat = QATConfig("int8-dynamic-int4-weight", convert_on_fit_end=False)

    def fit(epochs, model, ckpt_path=None):
        trainer = quiet_trainer(strategy=LowPrecisionStrategy(qat=qat, lora=lora), max_epochs=epochs)
        trainer.fit(model, _loader(batches=2), ckpt_path=ckpt_path)
        return trainer

    uninterrupted = _gpt()
    fit(2, uninterrupted)
    first = fit(1, _gpt())
    first.save_checkpoint(tmp_path / "half.ckpt")
    resumed = _gpt()
    fit(2, resumed, ckpt_path=tmp_path / "half.ckpt")
    for (name, expected), actual in zip(uninterrupted.state_dict().items(), resumed.state_dict().values(), strict=True):
        assert torch.equal(actual, expected), name


def test_lora_adapters_train_beside_the_fake_quantized_base_and_merge_into_the_quantized_weights(tmp_path):
    model, recorder = _gpt(), FakeQuantizedOutputs()
    strategy = LowPrecisionStrategy(qat="int8-dynamic-int4-weight", lora={"r": 4, "lora_alpha": 8})
    trainer = quiet_trainer(strategy=strategy, max_steps=3, callbacks=[recorder])
    trainer.fit(model, _loader())

    assert not any("lora_" in n for n in model.state_dict())  # merged, then quantized
    assert is_converted(model)
    with torch.no_grad():
        logits = model(_ids(seed=1)[:, :-1])
    torch.testing.assert_close(logits, recorder.logits, rtol=1e-5, atol=1e-5)
    path = save_quantized(model, tmp_path / "model.pt")
    state = torch.load(path, weights_only=True)
    assert torch.equal(state["blocks.0.mlp.0.weight"].qdata, model.blocks[0].mlp[0].weight.qdata)


def test_validate_after_fit_evaluates_the_quantized_model_and_a_second_fit_is_refused():
    model = _gpt()
    trainer = quiet_trainer(strategy=LowPrecisionStrategy(qat="int4-weight-only"), max_steps=1)
    trainer.fit(model, _loader())
    trainer.validate(model, _loader(1))
    assert is_converted(model)
    with pytest.raises(RuntimeError, match=r"converted to its quantized form at the end of an earlier fit"):
        quiet_trainer(strategy=LowPrecisionStrategy(qat="int4-weight-only"), max_steps=2).fit(model, _loader())


def test_unknown_scheme_is_refused_with_the_allowed_ones():
    with pytest.raises(ValueError, match=r"qat scheme 'int3' is not supported. Allowed: 'int8-dynamic-int4-weight'"):
        LowPrecisionStrategy(qat="int3")


def test_bad_group_size_is_refused():
    with pytest.raises(ValueError, match=r"qat group_size=0 is not valid"):
        QATConfig("int4-weight-only", group_size=0)


@pytest.mark.parametrize("settings", [{}, {"memory_saving": "auto"}], ids=["explicit", "auto"])
def test_group_size_that_does_not_divide_the_layers_is_refused_before_training(settings):
    """Under 'auto' settings the memory search's simulated step met the refusal first, and said it inside a
    warning ("the simulated step failed ...") before the run said it again: now it is said once."""
    import warnings

    model = _gpt()
    before = copy.deepcopy(model.state_dict())
    strategy = LowPrecisionStrategy(qat=QATConfig("int4-weight-only", group_size=48), **settings)
    trainer = quiet_trainer(strategy=strategy)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(ValueError, match=r"group_size=48 does not divide in_features of blocks.0.mlp.0 \(64\)"):
            trainer.fit(model, _loader())
    assert not [w for w in caught if "simulated step failed" in str(w.message)]
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_qat_with_bitsandbytes_quantization_is_refused():
    with pytest.raises(ValueError, match=r"quantization= and qat= cannot be combined: QAT fake-quantizes"):
        LowPrecisionStrategy(quantization="nf4", qat="int4-weight-only")


def test_estimate_counts_what_fake_quantization_saves_as_measured(tmp_path, monkeypatch):
    from pl_lowprec import MemoryTracker, estimate_memory

    monkeypatch.chdir(tmp_path)  # MemoryTracker writes its summary into the working directory
    tracker = MemoryTracker(print_summary=False)
    strategy = LowPrecisionStrategy(qat="int8-dynamic-int4-weight")
    quiet_trainer(strategy=strategy, max_steps=1, callbacks=[tracker]).fit(_gpt(), _loader(1))
    measured = tracker.summary["fit"]["bytes"]
    estimate = estimate_memory(_gpt, next(iter(_loader(1))), qat="int8-dynamic-int4-weight")
    plain = estimate_memory(_gpt, next(iter(_loader(1))))
    assert estimate.activations == measured["activations"] > plain.activations  # fake quantization saves more
    assert estimate.gradients == measured["gradients"]
