"""``pl-lowprec fit`` with CausalLM under a plain Lightning strategy (no ``--trainer.strategy``), where CausalLM
loads its own weights: a checkpoint that cannot load stops with one paragraph naming the key or file, no traceback.
Lightning's teardown moved the module, still on the meta device, to the CPU, and its "Cannot copy out of meta
tensor" replaced the cause."""

from __future__ import annotations

import shutil

import pytest
from loading_helpers import causal_lm_fit_args, rewrite_weights, save_pretrained_dir, write_prompt_completion

from pl_lowprec.cli import main

pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("bad_pretrained")
    return save_pretrained_dir(tmp / "model"), write_prompt_completion(tmp / "pc.jsonl")


def refusal(capsys, model_dir, data, root) -> str:
    with pytest.raises(SystemExit) as exit_info:
        main([*causal_lm_fit_args(model_dir, data), f"--trainer.default_root_dir={root}", "--trainer.max_steps=1"])
    message = capsys.readouterr().err
    assert "Traceback" not in message and "meta tensor" not in message, message[-2000:]
    assert exit_info.value.code == 2
    assert "fit stopped before its first step" in message
    return " ".join(message.split())


def test_a_missing_key_is_named_without_a_traceback(model, tmp_path, capsys):
    model_dir, data = model
    gone = "model.layers.0.mlp.up_proj.weight"
    edit = lambda state: {key: value for key, value in state.items() if key != gone}  # noqa: E731
    broken = rewrite_weights(model_dir, edit, copy_to=tmp_path / "broken")
    message = refusal(capsys, broken, data, tmp_path)
    assert "Missing from the checkpoint: model.model.layers.0.mlp.up_proj.weight." in message


def test_a_truncated_weights_file_is_named_without_a_traceback(model, tmp_path, capsys):
    model_dir, data = model
    cut = shutil.copytree(model_dir, tmp_path / "cut")
    weights = (cut / "model.safetensors").read_bytes()
    (cut / "model.safetensors").write_bytes(weights[: len(weights) // 2])
    message = refusal(capsys, cut, data, tmp_path)
    assert "model.safetensors" in message and "is not a complete safetensors file" in message


def test_weights_in_a_format_not_read_are_named_not_called_no_weights(model, tmp_path):
    """A directory with config.json and weights only as a .pth (pytorch_model.bin is read: test_torch_bin.py): the
    refusal names the file and the conversion, where it said twice that the directory has no weights."""
    import torch

    from pl_lowprec.models import CausalLM
    from pl_lowprec.transforms.config import TransformConfig
    from pl_lowprec.transforms.pipeline import ModelTransform

    model_dir, _ = model
    pth_dir = shutil.copytree(model_dir, tmp_path / "pth", ignore=shutil.ignore_patterns("*.safetensors"))
    torch.save(safetensors_torch.load_file(model_dir / "model.safetensors"), pth_dir / "consolidated.00.pth")
    with pytest.raises(FileNotFoundError) as refused:
        ModelTransform(TransformConfig()).weights_for(CausalLM(str(pth_dir)))  # what fit asks before loading
    message = str(refused.value)
    assert "It holds consolidated.00.pth: convert them to safetensors" in message
    assert "no weights" not in message
