"""LoRA initializations that rewrite the base weight (``init_lora_weights`` PiSSA, OLoRA: part of each weight moves
into A and B, the base keeps the residual). The merged export adds the deltas to that residual, not to the
original files' weight (which counted the moved part twice: with nothing trained, PiSSA's merged weights were off
by a third of their size), and an adapter directory, which loads onto the original base, is refused."""

from __future__ import annotations

import logging

import pytest
import torch
from lightning_helpers import quiet_trainer
from loading_helpers import LlamaModule, save_llama
from own_module_helpers import OWN_CAUSAL_LM as OWN_MODULE
from own_module_helpers import write_own_config, write_own_module
from qlora_helpers import ids_loader

from pl_lowprec import LowPrecisionStrategy
from pl_lowprec.cli import main

pytest.importorskip("bitsandbytes")
pytest.importorskip("peft")


def _logits(model, ids):
    model.eval()
    with torch.no_grad():
        return model(input_ids=ids).logits


def test_pissa_exports_merged_as_trained_and_refuses_an_adapter_directory(tmp_path, monkeypatch, capsys, caplog):
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
    assert any(
        "init_lora_weights='pissa' rewrote the base weights: export --merged." in r.getMessage() for r in caplog.records
    )
    (checkpoint,) = tmp_path.glob("runs/lightning_logs/version_0/checkpoints/*.ckpt")
    main(["export", "--ckpt_path", str(checkpoint), "--out", "merged", "--merged"])
    run = rebuild(["--config", "own.yaml"])
    trained = restore(checkpoint, run.trainer, run.model, run.datamodule).module.model
    ids = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(1))
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    torch.testing.assert_close(_logits(merged, ids), _logits(trained, ids), rtol=1e-4, atol=1e-4)

    monkeypatch.setattr("pl_lowprec.cli.export.restore", lambda *a: pytest.fail("restored before the refusal"))
    with pytest.raises(SystemExit):
        main(["export", "--ckpt_path", str(checkpoint), "--out", "adapter"])
    said = " ".join(capsys.readouterr().err.split())
    assert "lora init_lora_weights='pissa' rewrote the base weights when the adapters were added" in said
    assert "Export the merged model (--merged" in said and not (tmp_path / "adapter").exists()


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
    with pytest.raises(ValueError, match="init_lora_weights='olora' rewrote the base weights"):
        export_adapter(model, tmp_path / "adapter")
