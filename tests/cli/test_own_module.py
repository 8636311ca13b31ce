"""A LightningModule of the user's own, holding a Hugging Face model as ``self.model`` and building it in
``__init__``, through ``pl-lowprec fit`` with ``pretrained=`` on the strategy, then ``export --merged``: the CLI
builds it on the meta device (``cli/empty_model.py``) and the keys' ``model.`` prefix is taken (``key_match.py``)."""

from __future__ import annotations

import logging

import pytest
import torch
import yaml
from loading_helpers import save_llama
from own_module_helpers import OWN_CAUSAL_LM as OWN_MODULE
from own_module_helpers import write_own_config, write_own_module
from safetensors.torch import load_file

from pl_lowprec.cli import main

pytest.importorskip("bitsandbytes")
pytest.importorskip("peft")


def test_own_module_built_in_init_is_filled_from_the_strategys_pretrained_and_exports(tmp_path, monkeypatch, caplog):
    pretrained = save_llama(tmp_path / "pretrained")
    write_own_module(tmp_path, "own_lm", OWN_MODULE, monkeypatch)
    strategy = {"quantization": "nf4", "lora": {"r": 4}}
    write_own_config(tmp_path / "own.yaml", "own_lm.MyLM", "own_lm.Bytes", pretrained, strategy)
    with caplog.at_level(logging.INFO, logger="lightning.pytorch.utilities.rank_zero"):
        main(["fit", "--config", "own.yaml"])
    assert sum("took pretrained_prefix='model.'" in r.getMessage() for r in caplog.records) == 1
    (checkpoint,) = tmp_path.glob("runs/lightning_logs/version_0/checkpoints/*.ckpt")
    assert torch.load(checkpoint, weights_only=False)["global_step"] == 2

    main(["export", "--ckpt_path", str(checkpoint), "--out", "merged", "--merged"])
    original, merged = load_file(pretrained / "model.safetensors"), load_file(tmp_path / "merged/model.safetensors")
    assert merged.keys() == original.keys()
    assert torch.equal(merged["model.norm.weight"], original["model.norm.weight"])  # not adapted: as it was
    changed = [k for k in original if not torch.equal(merged[k], original[k])]
    assert changed and all(k.endswith("proj.weight") for k in changed)  # the LoRA deltas, merged in


def test_a_strategys_pretrained_with_only_config_json_is_estimated_and_refused_for_fit(tmp_path, monkeypatch, capsys):
    """An 8B's config.json is all a laptop has before the download: ``estimate`` takes it, as it takes it from
    ``CausalLM(pretrained=)``, with the figure the weights would give; ``fit`` says what is missing."""
    from loading_helpers import llama_config

    from pl_lowprec.cli.estimate import estimate_config

    with_weights = save_llama(tmp_path / "with_weights")
    shapes = tmp_path / "shapes"
    llama_config().save_pretrained(shapes)
    write_own_module(tmp_path, "own_lm", OWN_MODULE, monkeypatch)
    peaks = {}
    for source in (with_weights, shapes):
        config = tmp_path / f"{source.name}.yaml"
        write_own_config(config, "own_lm.MyLM", "own_lm.Bytes", source, {"quantization": "nf4", "lora": {"r": 4}}, 1)
        peaks[source.name] = estimate_config(["--config", str(config)]).peak
    assert peaks["shapes"] == peaks["with_weights"] > 0
    main(["plan", "--config", "shapes.yaml", "--memory", "2GiB", "--out", "planned.yaml"])
    assert "Chosen: micro-batch 1 x 1" in capsys.readouterr().out
    assert yaml.safe_load((tmp_path / "planned.yaml").read_text())["trainer"]["strategy"]["init_args"]["pretrained"]
    with pytest.raises(SystemExit):
        main(["fit", "--config", "shapes.yaml"])
    said = " ".join(capsys.readouterr().err.split())
    assert f"pretrained={str(shapes)!r} has a config.json but no weights: that is enough for `pl-lowprec" in said


def test_biases_trained_under_lora_only_resume_and_merge_as_they_trained(tmp_path, monkeypatch):
    """``bias='lora_only'``: each LoRA layer's base holds a trainable bias beside its frozen nf4 weight. The
    adapter-only checkpoint keeps the bias, resume and export load it (they asked for the frozen weight too), and
    the merged model holds the trained bias."""
    pretrained = save_llama(tmp_path / "pretrained", attention_bias=True)
    write_own_module(tmp_path, "own_lm", OWN_MODULE, monkeypatch)
    strategy = {"quantization": "nf4", "lora": {"r": 4, "bias": "lora_only"}}
    write_own_config(tmp_path / "own.yaml", "own_lm.MyLM", "own_lm.Bytes", pretrained, strategy)
    main(["fit", "--config", "own.yaml"])
    (first,) = tmp_path.glob("runs/lightning_logs/version_0/checkpoints/*.ckpt")
    main(["fit", "--config", "own.yaml", "--trainer.max_steps", "3", "--ckpt_path", str(first)])
    (resumed,) = tmp_path.glob("runs/lightning_logs/version_1/checkpoints/*.ckpt")
    state = torch.load(resumed, weights_only=False)
    assert state["global_step"] == 3
    key = "model.model.layers.0.self_attn.q_proj.base_layer.bias"
    trained = state["state_dict"][key]

    main(["export", "--ckpt_path", str(resumed), "--out", "merged", "--merged"])
    original, merged = load_file(pretrained / "model.safetensors"), load_file(tmp_path / "merged/model.safetensors")
    plain = "model.layers.0.self_attn.q_proj.bias"
    assert not torch.equal(trained.float(), original[plain])  # it trained
    torch.testing.assert_close(merged[plain], trained.to(original[plain].dtype), rtol=0, atol=0)


OWN_LOADER = """

class MyLMWithData(MyLM):
    def train_dataloader(self):
        return Bytes().train_dataloader()
"""


def test_a_module_with_its_own_loader_is_estimated_and_planned_without_a_data_section(tmp_path, monkeypatch, capsys):
    """fit takes the module's own train_dataloader; estimate and plan take their batch from it too (they demanded a
    data section fit does not need). The plan keeps that loader's micro-batch, which nothing else sets."""
    from loading_helpers import llama_config

    from pl_lowprec.cli.estimate import estimate_config

    shapes = tmp_path / "shapes"
    llama_config().save_pretrained(shapes)
    write_own_module(tmp_path, "own_lm_loader", OWN_MODULE + OWN_LOADER, monkeypatch)  # a name of its own: not cached
    strategy = {"quantization": "nf4", "lora": {"r": 4}}
    write_own_config(tmp_path / "with_data.yaml", "own_lm_loader.MyLM", "own_lm_loader.Bytes", shapes, strategy, 1)
    config = yaml.safe_load(
        write_own_config(tmp_path / "own.yaml", "own_lm_loader.MyLMWithData", "-", shapes, strategy, 1).read_text()
    )
    del config["data"]
    (tmp_path / "own.yaml").write_text(yaml.safe_dump(config))
    assert estimate_config(["--config", "own.yaml"]).peak == estimate_config(["--config", "with_data.yaml"]).peak
    main(["plan", "--config", "own.yaml", "--memory", "2GiB", "--out", "planned.yaml"])
    out = capsys.readouterr().out
    assert "Batch: 1 rows x 16 positions, the first training batch (MyLMWithData does not say" in out
    assert "micro-batch 1 x 1" in out and "data" not in yaml.safe_load((tmp_path / "planned.yaml").read_text())
    with pytest.raises(SystemExit):
        main(["plan", "--config", "own.yaml", "--memory", "2GiB", "--maximize", "batch_size"])
    assert "--maximize batch_size changes the data module's batch_size, and the config" in capsys.readouterr().err
