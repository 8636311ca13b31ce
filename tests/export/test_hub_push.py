"""export --push_to_hub's parts without a model: the base model's hub id, the model card of each export, and the
note for an adapter whose base is a directory of this machine."""

import json

import pytest

from pl_lowprec.export.hub_push import base_model_id, model_card, push

pytest.importorskip("huggingface_hub")


def test_the_base_models_id_is_a_hub_id_or_its_download_never_a_local_directory(tmp_path):
    snapshot = tmp_path / "hub" / "models--Qwen--Qwen2.5-0.5B" / "snapshots" / "abc"
    snapshot.mkdir(parents=True)
    local = tmp_path / "models" / "qwen"
    local.mkdir(parents=True)
    assert base_model_id(tmp_path, "Qwen/Qwen2.5-0.5B") == "Qwen/Qwen2.5-0.5B"
    assert base_model_id(tmp_path, snapshot) == "Qwen/Qwen2.5-0.5B"
    assert base_model_id(tmp_path, local) is None and base_model_id(tmp_path) is None
    (tmp_path / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": str(snapshot)}))
    assert base_model_id(tmp_path, local) == "Qwen/Qwen2.5-0.5B"  # the adapter's own record comes first


def test_a_gguf_card_has_no_library_and_names_its_files(tmp_path):
    (tmp_path / "model-q4_k_m.gguf").write_bytes(b"GGUF")
    (tmp_path / "model-q8_0.gguf").write_bytes(b"GGUF")
    card = model_card(tmp_path, "me/gguf", "org/base")
    assert "library_name" not in card and "- gguf\n" in card and "base_model: org/base\n" in card
    assert "(model-q4_k_m.gguf, model-q8_0.gguf)" in card
    assert "hf download me/gguf --local-dir model\nllama-cli -m model/model-q4_k_m.gguf" in card


def test_an_adapter_on_a_local_base_is_pushed_with_how_others_load_it(tmp_path, monkeypatch):
    from types import SimpleNamespace

    import huggingface_hub

    class Api:
        def create_repo(self, *args, **kwargs):
            pass

        def upload_folder(self, **kwargs):
            return SimpleNamespace(commit_url="https://huggingface.co/me/a/commit/1")

    monkeypatch.setattr(huggingface_hub, "HfApi", Api)
    (tmp_path / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": "/data/models/base"}))
    line = push(tmp_path, "me/a", private=False)
    assert line.startswith(f"Uploaded {tmp_path} to https://huggingface.co/me/a: https://huggingface.co/me/a/commit/1.")
    assert "names the base as '/data/models/base', a directory of this machine" in line
    assert "PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(BASE), 'me/a')" in line
    assert "base_model" not in (tmp_path / "README.md").read_text()
