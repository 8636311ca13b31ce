"""LoRA initializations that rewrite the base weight (``init_lora_weights`` PiSSA, OLoRA: part of each weight moves
into A and B, the base keeps the residual). The merged export adds the deltas to that residual, not to the
original files' weight (which counted the moved part twice: with nothing trained, PiSSA's merged weights were off
by a third of their size), and the adapter directory, which loads onto the original base, is peft's conversion to
a LoRA of twice the rank (``[A; A0]``, ``[B | -B0]``) from the adapters as initialised, which the strategy keeps."""

from __future__ import annotations

import json
import logging
import re

import pytest
import torch
from lightning_helpers import quiet_trainer
from loading_helpers import LlamaModule, save_llama
from own_module_helpers import OWN_CAUSAL_LM as OWN_MODULE
from own_module_helpers import write_own_config, write_own_module
from qlora_helpers import ids_loader

from pl_lowprec import LowPrecisionStrategy
from pl_lowprec.cli import main
from pl_lowprec.transforms.initial_adapters import initial_adapters

pytest.importorskip("bitsandbytes")
peft = pytest.importorskip("peft")


def _logits(model, ids):
    model.eval()
    with torch.no_grad():
        return model(input_ids=ids).logits


def test_pissa_exports_merged_as_trained_and_an_adapter_for_the_original_base(tmp_path, monkeypatch, caplog):
    from transformers import AutoModelForCausalLM

    from pl_lowprec.cli.rebuild import rebuild
    from pl_lowprec.export.restore import restore

    pretrained = save_llama(tmp_path / "pretrained")
    write_own_module(tmp_path, "own_lm", OWN_MODULE, monkeypatch)
    write_own_config(
        tmp_path / "own.yaml",
        "own_lm.MyLM",
        "own_lm.Bytes",
        pretrained,
        {"lora": {"r": 4, "init_lora_weights": "pissa"}},
    )
    with caplog.at_level(logging.INFO, logger="lightning.pytorch.utilities.rank_zero"):
        main(["fit", "--config", "own.yaml"])
    line = "init_lora_weights='pissa' rewrote the base weights: the adapter export is a LoRA of twice the rank"
    assert any(line in r.getMessage() for r in caplog.records)
    (checkpoint,) = tmp_path.glob("runs/lightning_logs/version_0/checkpoints/*.ckpt")
    main(["export", "--ckpt_path", str(checkpoint), "--out", "merged", "--merged"])
    run = rebuild(["--config", "own.yaml"])
    trained = restore(checkpoint, run.trainer, run.model, run.datamodule).module.model
    ids = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(1))
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    torch.testing.assert_close(_logits(merged, ids), _logits(trained, ids), rtol=1e-4, atol=1e-4)

    main(["export", "--ckpt_path", str(checkpoint), "--out", "adapter"])  # onto the original base, as peft loads it
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], config["init_lora_weights"]) == (8, 16, True)  # peft's conversion
    original = AutoModelForCausalLM.from_pretrained(pretrained)
    before = _logits(original, ids)
    adapted = peft.PeftModel.from_pretrained(original, str(tmp_path / "adapter"))
    torch.testing.assert_close(_logits(adapted, ids), _logits(trained, ids), rtol=1e-4, atol=1e-4)
    assert (before - _logits(trained, ids)).abs().max() > 1e-3  # it trained: the adapter is not a no-op


def test_olora_on_a_quantized_base_merges_into_its_dequantized_residual(tmp_path):
    """OLoRA re-quantizes the residual it leaves in the base: the merge dequantizes that residual, so the merged
    model computes what the trained one did."""
    from transformers import AutoModelForCausalLM

    from pl_lowprec.adapters import export_adapter
    from pl_lowprec.export.merged import merge_into_pretrained
    from pl_lowprec.loading import PretrainedWeights

    directory = save_llama(tmp_path / "pretrained")
    lora = {"r": 4, "init_lora_weights": "olora"}
    trainer = quiet_trainer(
        strategy=LowPrecisionStrategy(pretrained=directory, quantization="nf4", lora=lora), max_steps=2
    )
    with trainer.init_module(empty_init=True):
        model = LlamaModule()
    trainer.fit(model, ids_loader(batches=2))
    out = tmp_path / "merged"
    out.mkdir()
    merge_into_pretrained(model, PretrainedWeights(directory, prefix="model."), out)
    ids = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(1))
    merged = AutoModelForCausalLM.from_pretrained(out)
    torch.testing.assert_close(_logits(merged, ids), _logits(model.model, ids), rtol=1e-3, atol=1e-3)
    # The converted adapter on the original full-precision base: its delta is scale * (B @ A - B0 @ A0), so the
    # model differs from the trained one only by the residual's quantization, as any QLoRA adapter does.
    export_adapter(model, tmp_path / "adapter")
    original = AutoModelForCausalLM.from_pretrained(directory)
    plain = {k: v.clone() for k, v in original.state_dict().items()}
    unloaded = peft.PeftModel.from_pretrained(original, str(tmp_path / "adapter")).merge_and_unload().state_dict()
    layer = model.model.model.layers[0].self_attn.q_proj
    a, b = layer.lora_A["default"].weight, layer.lora_B["default"].weight
    a0, b0 = initial_adapters(layer)
    expected = plain["model.layers.0.self_attn.q_proj.weight"] + layer.scaling["default"] * (b @ a - b0 @ a0)
    torch.testing.assert_close(unloaded["model.layers.0.self_attn.q_proj.weight"], expected, rtol=1e-5, atol=1e-6)


class Untrained(LlamaModule):
    def configure_optimizers(self):
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=0.0)


@pytest.mark.parametrize("init", ["pissa", "olora"])
def test_with_nothing_trained_the_converted_adapter_leaves_the_original_model(tmp_path, init):
    """A0 and B0 cancel what the initialization moved: the converted adapter of an untrained model adds nothing."""
    from transformers import AutoModelForCausalLM

    from pl_lowprec.adapters import export_adapter

    directory = save_llama(tmp_path / "pretrained")
    lora = {"r": 4, "init_lora_weights": init}
    trainer = quiet_trainer(strategy=LowPrecisionStrategy(pretrained=directory, lora=lora), max_steps=1)
    with trainer.init_module(empty_init=True):
        model = Untrained()
    trainer.fit(model, ids_loader(batches=1))  # the model transformed, one step that changes nothing
    assert initial_adapters(model.model.model.layers[0].self_attn.q_proj) is not None
    ids = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(1))
    original = AutoModelForCausalLM.from_pretrained(directory)
    before = _logits(original, ids)
    export_adapter(model, tmp_path / "adapter")
    adapted = peft.PeftModel.from_pretrained(original, str(tmp_path / "adapter"))
    torch.testing.assert_close(_logits(adapted, ids), before, rtol=1e-5, atol=1e-5)
    assert adapted.peft_config["default"].r == 8


@pytest.mark.parametrize(
    ("option", "said"),
    [
        ({"use_dora": True}, "with use_dora=True: the adapter directory for the original base is a LoRA"),
        ({"use_rslora": True, "rank_pattern": {"q_proj": 8}}, "with use_rslora=True and rank_pattern or alpha"),
    ],
)
def test_what_the_conversion_cannot_express_is_refused_with_the_merged_export_as_the_fix(tmp_path, option, said):
    from peft import LoraConfig

    from pl_lowprec.transforms.initial_adapters import check_convertible, converted_config

    config = LoraConfig(r=4, init_lora_weights="pissa", **option)
    with pytest.raises(ValueError, match=re.escape(said)) as refused:
        check_convertible(config, {})
        converted_config(config)
    assert "Export the merged model (--merged)" in str(refused.value)
