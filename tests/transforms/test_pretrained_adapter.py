"""``pretrained_adapter=``: LoRA training continues a saved peft adapter directory, as peft's
``PeftModel.from_pretrained(base, dir, is_trainable=True)`` and axolotl's ``lora_model_dir`` do.

The numbers are peft's: logits before training equal the peft model's, and three steps' losses equal a plain loop
training that peft model (fp32, same data and AdamW). The adapter's own config is used; lora= that disagrees, an
adapter of another base, and a directory that is no adapter are refused in one paragraph.
"""

from __future__ import annotations

import dataclasses

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.plugins.precision import Precision
from lightning_helpers import quiet_trainer
from loading_helpers import LlamaModule, save_llama, stand_in_hub
from qlora_helpers import LossRecorder, ids_loader

from pl_lowprec import LowPrecisionStrategy
from pl_lowprec.adapters import export_adapter

peft = pytest.importorskip("peft")

IDS = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(1))
TRAINED_BEFORE = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj", "down_proj"]}


def _base(directory, **config):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(directory, **config)


def _save_adapter(base_dir, out, **lora):
    """A peft adapter as ``PeftModel.save_pretrained`` writes it, with B non-zero (as after training)."""
    torch.manual_seed(3)
    model = peft.get_peft_model(_base(base_dir), peft.LoraConfig(**{**TRAINED_BEFORE, **lora}))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name or "modules_to_save" in name:
                param.add_(torch.randn_like(param) * 0.05)
    model.save_pretrained(out)
    return out


def _peft_reference(base_dir, adapter):
    return peft.PeftModel.from_pretrained(_base(base_dir), str(adapter), is_trainable=True)


def _logits(model):
    model.eval()
    with torch.no_grad():
        return model(input_ids=IDS).logits


def _transformed(base_dir, **strategy_args):
    """The user's module (the Hugging Face model as ``self.model``) with the base's weights, transformed."""
    module = LlamaModule()
    module.model.load_state_dict(_base(base_dir).state_dict())
    strategy = LowPrecisionStrategy(**strategy_args)
    strategy.transform.apply(module, Precision(), torch.device("cpu"))
    return module


@pytest.fixture
def base_dir(tmp_path):
    return save_llama(tmp_path / "base")


@pytest.mark.parametrize(
    "lora",
    [{}, {"use_rslora": True, "use_dora": True, "modules_to_save": ["lm_head"]}],
    ids=["plain", "rslora-dora-modules_to_save"],
)
def test_logits_before_training_equal_peft_from_pretrained(base_dir, tmp_path, lora):
    adapter = _save_adapter(base_dir, tmp_path / "adapter", **lora)
    module = _transformed(base_dir, pretrained_adapter=adapter)
    config = module.peft_config["default"]
    assert (config.r, config.lora_alpha, config.use_rslora, config.use_dora) == (
        4,
        8,
        bool(lora),
        bool(lora),
    )
    assert not config.inference_mode
    reference = _peft_reference(base_dir, adapter)
    trainable = {n for n, p in module.model.named_parameters() if p.requires_grad}
    in_peft = {n.removeprefix("base_model.model.") for n, p in reference.named_parameters() if p.requires_grad}
    assert trainable == in_peft
    assert torch.equal(_logits(module.model), _logits(reference))
    assert not torch.equal(_logits(module.model), _logits(_base(base_dir)))  # the adapter's B is not zero


def _fit(base_dir, adapter, steps=3, strategy_class=LowPrecisionStrategy, **strategy_args):
    recorder = LossRecorder()
    strategy = strategy_class(pretrained=base_dir, pretrained_adapter=adapter, **strategy_args)
    trainer = quiet_trainer(strategy=strategy, max_steps=steps, callbacks=[recorder])
    with trainer.init_module(empty_init=True):
        module = LlamaModule()
    trainer.fit(module, ids_loader(batches=steps))
    return module, recorder.losses


def test_three_steps_equal_a_loop_training_the_peft_model_and_the_export_loads_with_peft(base_dir, tmp_path):
    adapter = _save_adapter(base_dir, tmp_path / "adapter", use_rslora=True)
    module, losses = _fit(base_dir, adapter)

    torch.manual_seed(0)
    reference = _peft_reference(base_dir, adapter)
    optimizer = torch.optim.AdamW([p for p in reference.parameters() if p.requires_grad], lr=1e-2)
    expected = []
    for batch in ids_loader(batches=3):
        loss = reference(input_ids=batch["input_ids"], labels=batch["input_ids"]).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        expected.append(float(loss))
    torch.testing.assert_close(losses, expected, rtol=1e-6, atol=0)
    assert losses[-1] < losses[0]
    trained = _logits(module.model)
    torch.testing.assert_close(trained, _logits(reference), rtol=1e-5, atol=1e-5)

    exported = export_adapter(module, tmp_path / "exported")
    torch.testing.assert_close(_logits(_peft_reference(base_dir, exported)), trained, rtol=0, atol=0)


def test_an_adapter_this_package_exported_continues_under_the_users_module(base_dir, tmp_path):
    """The export names its targets by a regular expression over the Hugging Face model's names; the user's module
    holds that model as ``self.model``, so the names carry ``model.`` in front."""
    adapter = _save_adapter(base_dir, tmp_path / "adapter")
    module, _ = _fit(base_dir, adapter, steps=1)
    exported = export_adapter(module, tmp_path / "exported")
    assert isinstance(peft.LoraConfig.from_pretrained(exported).target_modules, str)
    again = _transformed(base_dir, pretrained_adapter=exported)
    torch.testing.assert_close(_logits(again.model), _logits(module.model), rtol=0, atol=0)


def test_lora_options_that_differ_from_the_saved_config_are_refused(base_dir, tmp_path):
    adapter = _save_adapter(base_dir, tmp_path / "adapter")
    with pytest.raises(ValueError) as refused:
        LowPrecisionStrategy(pretrained_adapter=adapter, lora={"r": 8, "lora_alpha": 8, "use_dora": True})
    said = str(refused.value)
    assert "\n" not in said
    assert f"pretrained_adapter={str(adapter)!r} brings its own LoraConfig" in said
    assert "r=8 (saved: 4), use_dora=True (saved: False)." in said
    assert "lora_alpha" not in said.split("Fix")[0].split("values:")[1]  # the same value is no conflict
    assert "Fix: drop these from lora=" in said
    # the same values, and lora_dropout, which changes training only, are taken
    strategy = LowPrecisionStrategy(pretrained_adapter=adapter, lora={"r": 4, "lora_dropout": 0.1})
    assert (strategy.transform_config.lora.r, strategy.transform_config.lora.lora_dropout) == (4, 0.1)


def test_a_lora_config_object_beside_the_adapter_is_compared_at_its_default_rank_too(base_dir, tmp_path):
    """LoraConfig(r=8) holds peft's default rank, which a dict of fields would leave unset: against a rank-4 adapter
    it is refused, not trained at rank 4 in silence; an object equal to the saved config is taken."""
    from peft import LoraConfig

    adapter = _save_adapter(base_dir, tmp_path / "adapter")
    with pytest.raises(ValueError, match=r"r=8 \(saved: 4\).* give lora= as a dict of the fields to set"):
        LowPrecisionStrategy(pretrained_adapter=adapter, lora=LoraConfig(**{**TRAINED_BEFORE, "r": 8}))
    strategy = LowPrecisionStrategy(pretrained_adapter=adapter, lora=LoraConfig(**TRAINED_BEFORE, lora_dropout=0.1))
    assert (strategy.transform_config.lora.r, strategy.transform_config.lora.lora_dropout) == (4, 0.1)
    again = dataclasses.replace(strategy.transform_config, memory_saving=True)  # as plan and auto try candidates
    assert again.lora.r == 4


def test_an_adapter_of_another_base_is_refused_naming_the_adapter_the_base_and_a_tensor(base_dir, tmp_path):
    other = save_llama(tmp_path / "other", hidden_size=32)
    adapter = _save_adapter(other, tmp_path / "adapter")
    with pytest.raises(ValueError) as refused:
        _transformed(base_dir, pretrained_adapter=adapter)
    said = str(refused.value)
    assert f"pretrained_adapter={str(adapter)!r} does not fit the model: 12 tensors have other shapes (e.g." in said
    assert "model.layers.0.self_attn.q_proj.lora_A.default.weight: [4, 32] in the checkpoint, [4, 64]" in said
    assert f"adapter_config.json names {str(other)!r}) than this run's (LlamaForCausalLM)." in said


def test_a_directory_that_is_no_adapter_and_an_unreachable_hub_id_are_refused(base_dir, tmp_path, monkeypatch):
    with pytest.raises(ValueError, match=r"has no adapter_config.json: .* a model directory, which pretrained= takes"):
        LowPrecisionStrategy(pretrained_adapter=base_dir)
    adapter = _save_adapter(base_dir, tmp_path / "adapter")
    stand_in_hub(monkeypatch, tmp_path / "cache", {"org/adapter": adapter})
    strategy = LowPrecisionStrategy(pretrained_adapter="org/adapter")
    assert strategy.transform_config.adapter_directory.parts[-3:] == ("models--org--adapter", "snapshots", "0123abc")
    assert strategy.transform_config.lora.r == 4
    offline = r"`hf download org/missing --local-dir DIR`\) and pass pretrained_adapter=DIR"
    with pytest.raises(ValueError, match=offline):
        LowPrecisionStrategy(pretrained_adapter="org/missing")


@pytest.mark.parametrize("mode", ["nf4", "int8"])
def test_qlora_continues_the_adapter_on_the_quantized_base(base_dir, tmp_path, mode):
    pytest.importorskip("bitsandbytes")
    from safetensors.torch import load_file

    adapter = _save_adapter(base_dir, tmp_path / "adapter")
    saved = load_file(adapter / "adapter_model.safetensors")
    module, losses = _fit(base_dir, adapter, steps=1, quantization=mode)
    q_proj = module.model.model.layers[0].self_attn.q_proj
    assert type(q_proj.base_layer).__name__ == ("Linear4bit" if mode == "nf4" else "Linear8bitLt")
    assert torch.isfinite(torch.tensor(losses)).all()
    key = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
    start = _transformed(base_dir, pretrained_adapter=adapter, quantization=mode)
    start_q = start.model.model.layers[0].self_attn.q_proj
    assert torch.equal(start_q.lora_A["default"].weight.detach(), saved[key])
    assert not torch.equal(q_proj.lora_A["default"].weight.detach(), saved[key])  # and it trained on


def test_the_memory_estimate_takes_the_adapters_shapes(base_dir, tmp_path):
    """The estimator runs the strategy's transform on a meta-device model: the adapter's config gives the LoRA its
    shapes, and nothing is loaded (before the adapter's weights are downloaded, as for pretrained=)."""
    from pl_lowprec import estimate_memory

    adapter = _save_adapter(base_dir, tmp_path / "adapter", r=8, use_dora=True, modules_to_save=["lm_head"])
    in_peft = sum(p.numel() for p in _peft_reference(base_dir, adapter).parameters() if p.requires_grad)
    (adapter / "adapter_model.safetensors").unlink()  # adapter_config.json is all an estimate needs
    batch = {"input_ids": IDS}
    saved = estimate_memory(LlamaModule, batch, pretrained_adapter=adapter)
    alike = {**TRAINED_BEFORE, "r": 8, "use_dora": True, "modules_to_save": ["lm_head"]}
    assert saved.trainable_parameters == estimate_memory(LlamaModule, batch, lora=alike).trainable_parameters
    assert saved.trainable_parameters == in_peft
    assert saved.peak == estimate_memory(LlamaModule, batch, lora=alike).peak


@pytest.mark.usefixtures("no_process_group_left")
@pytest.mark.parametrize("strategy_name", ["lowprec_ddp", "lowprec_fsdp"])
def test_every_strategy_continues_the_adapter(base_dir, tmp_path, strategy_name):
    """One process each: the same transform loads the adapter under DDP's and FSDP2's strategies."""
    from pl_lowprec import LowPrecisionDDPStrategy, LowPrecisionFSDPStrategy

    adapter = _save_adapter(base_dir, tmp_path / "adapter")
    cls = {"lowprec_ddp": LowPrecisionDDPStrategy, "lowprec_fsdp": LowPrecisionFSDPStrategy}[strategy_name]
    _, losses = _fit(base_dir, adapter, steps=1, strategy_class=cls)
    ids = next(iter(ids_loader(batches=1)))["input_ids"]
    with torch.no_grad():
        first = _peft_reference(base_dir, adapter)(input_ids=ids, labels=ids).loss
    assert losses == [pytest.approx(float(first), rel=1e-6)]  # the loss of the adapter as saved


def test_pl_lowprec_fit_continues_the_adapter_named_in_the_yaml(base_dir, tmp_path, monkeypatch, caplog):
    import logging

    from own_module_helpers import OWN_CAUSAL_LM, write_own_config, write_own_module

    from pl_lowprec.cli import main

    adapter = _save_adapter(base_dir, tmp_path / "adapter", use_rslora=True)
    write_own_module(tmp_path, "own_lm", OWN_CAUSAL_LM, monkeypatch)
    strategy = {"pretrained_adapter": str(adapter), "lora": {"lora_dropout": 0.0}}
    write_own_config(tmp_path / "own.yaml", "own_lm.MyLM", "own_lm.Bytes", base_dir, strategy, max_steps=1)
    with caplog.at_level(logging.INFO, logger="lightning.pytorch.utilities.rank_zero"):
        main(["fit", "--config", "own.yaml"])
    said = [r.getMessage() for r in caplog.records if "LoRA continues the adapter" in r.getMessage()]
    assert said == [
        f"LoRA continues the adapter {str(adapter)!r}: 12 tensors loaded, its config (r=4, lora_alpha=8,"
        " use_rslora=True, use_dora=False)."
    ]
    (checkpoint,) = tmp_path.glob("runs/lightning_logs/version_0/checkpoints/*.ckpt")
    main(["export", "--ckpt_path", str(checkpoint), "--out", "exported"])
    exported = peft.LoraConfig.from_pretrained(tmp_path / "exported")
    assert (exported.r, exported.lora_alpha, exported.use_rslora) == (4, 8, True)


@pytest.mark.slow
def test_lowprec_fsdp_on_two_ranks_continues_the_adapter(base_dir, tmp_path):
    """Each rank holds only its rows of the base when LoRA is added; the adapter (with a head trained whole) loads
    on every rank, and the first loss is peft's for the adapter as saved."""
    import sys
    from pathlib import Path

    import warm_python

    pytest.importorskip("torchao")
    adapter = _save_adapter(base_dir, tmp_path / "adapter", modules_to_save=["lm_head"])
    script = Path(__file__).parents[1] / "_scripts" / "fsdp_adapter.py"
    command = [sys.executable, str(script), str(base_dir), str(adapter), str(tmp_path / "out")]
    result = warm_python.run(command, timeout=600, ranks=2)
    assert result.returncode == 0, result.stderr[-4000:]
    ids = next(iter(ids_loader(batches=1)))["input_ids"]
    with torch.no_grad():
        first = float(_peft_reference(base_dir, adapter)(input_ids=ids, labels=ids).loss)
    for rank in range(2):
        losses = torch.load(tmp_path / "out" / f"rank{rank}.pt")["losses"]
        assert losses == [pytest.approx(first, rel=1e-6)]


class _StartWeights(pl.Callback):
    """The trainable tensors as the first step will see them (after a resume has restored its checkpoint)."""

    def on_train_start(self, trainer, pl_module) -> None:
        self.weights = {n: p.detach().clone() for n, p in pl_module.named_parameters() if p.requires_grad}


def _fit_from(base_dir, adapter, max_steps, ckpt_path=None, save_in=None):
    """2 steps an epoch, so that a run saved after 2 steps resumes at an epoch's start; ``save_in``: ``last.ckpt``
    there, as ``ModelCheckpoint`` writes it during fit."""
    recorder, start = LossRecorder(), _StartWeights()
    callbacks = [recorder, start] + ([ModelCheckpoint(dirpath=save_in, save_last=True)] if save_in else [])
    strategy = LowPrecisionStrategy(pretrained=base_dir, pretrained_adapter=adapter)
    trainer = quiet_trainer(
        strategy=strategy, max_steps=max_steps, callbacks=callbacks, enable_checkpointing=bool(save_in)
    )
    with trainer.init_module(empty_init=True):
        module = LlamaModule()
    trainer.fit(module, ids_loader(batches=2), ckpt_path=ckpt_path)
    return module, recorder.losses, start.weights


def test_a_resumed_fit_trains_on_from_the_checkpoints_adapter_not_the_pretrained_one(base_dir, tmp_path):
    """``Trainer.fit(ckpt_path=)`` with ``pretrained_adapter=``: the strategy loads the saved adapter when it builds
    the model, then Lightning restores the checkpoint over it; the steps after the resume see the checkpoint's
    adapter (trained two steps) and their losses equal the unbroken run's."""
    adapter = _save_adapter(base_dir, tmp_path / "adapter")
    unbroken, unbroken_losses, _ = _fit_from(base_dir, adapter, max_steps=4)
    _, first_losses, _ = _fit_from(base_dir, adapter, max_steps=2, save_in=tmp_path / "run")
    checkpoint = tmp_path / "run" / "last.ckpt"
    resumed, resumed_losses, at_resume = _fit_from(base_dir, adapter, max_steps=4, ckpt_path=checkpoint)

    saved = torch.load(checkpoint, weights_only=True)["state_dict"]
    assert set(at_resume) <= set(saved) and any("lora_B" in n for n in at_resume)
    for name, tensor in at_resume.items():
        assert torch.equal(tensor, saved[name]), name
    fresh = _transformed(base_dir, pretrained_adapter=adapter)  # the adapter as saved by peft
    q_b = "model.model.layers.0.self_attn.q_proj.lora_B.default.weight"
    assert not torch.equal(at_resume[q_b], dict(fresh.named_parameters())[q_b].detach())
    torch.testing.assert_close(first_losses + resumed_losses, unbroken_losses, rtol=1e-6, atol=0)
    for (name, a), (_, b) in zip(resumed.named_parameters(), unbroken.named_parameters(), strict=True):
        if a.requires_grad:
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7, msg=name)
