"""``export --push_to_hub REPO``: the written directory uploaded to the Hugging Face Hub with a model card, as
``push_to_hub`` in transformers, peft and TRL shares a fine-tune.

The repository id and a token are checked before anything loads; the upload comes after the export is complete on
disk, so a failed upload loses nothing and its refusal names ``hf upload`` with the directory.
"""

from __future__ import annotations

from pathlib import Path

from pl_lowprec._error_text import briefly
from pl_lowprec.adapters import recorded_base
from pl_lowprec.loading.hub import DOWNLOAD_COMMAND, hub_id_of, is_hub_id

UPLOAD_COMMAND = "hf upload"  # huggingface_hub's command line, as hub.DOWNLOAD_COMMAND


def check_push(repo_id: str | None, private: bool) -> None:
    """Before anything loads: ``--private`` only with ``--push_to_hub``, a valid repository id, and a token."""
    if repo_id is None:
        if private:
            raise ValueError("--private makes the --push_to_hub repository private: pass --push_to_hub USER/NAME too.")
        return
    from huggingface_hub import get_token
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        if repo_id.count("/") != 1:
            raise HFValidationError("name it as 'user/name' or 'org/name'")
        validate_repo_id(repo_id)
    except HFValidationError as err:
        raise ValueError(f"--push_to_hub {repo_id!r} is not a model repository id: {err}") from err
    if get_token() is None:
        raise ValueError(
            f"--push_to_hub {repo_id!r} needs a Hugging Face token with write access, and none is set here: run"
            f" `hf auth login` (or set HF_TOKEN) and export again, or export without --push_to_hub and upload the"
            f" directory later with `{UPLOAD_COMMAND} {repo_id} OUT`."
        )


def base_model_id(directory: Path, pretrained: str | Path | None = None) -> str | None:
    """The hub id of the model a fine-tune came from, where there is one: the adapter's recorded base, or the
    pretrained weights' (a hub id, or its download in the Hugging Face cache)."""
    pretrained = recorded_base(directory) if (directory / "adapter_config.json").is_file() else pretrained
    if pretrained is None:
        return None
    if is_hub_id(pretrained):
        return str(pretrained)
    return hub_id_of(pretrained) if Path(pretrained).is_dir() else None


def model_card(directory: Path, repo_id: str, base_model: str | None) -> str:
    """README.md: the hub's metadata (library, base model, tags) and how to load what the directory holds."""
    from huggingface_hub import ModelCard, ModelCardData

    ggufs = sorted(p.name for p in directory.glob("*.gguf"))
    source = f"[{base_model}](https://huggingface.co/{base_model})" if base_model else "a local model"
    if (directory / "adapter_config.json").is_file():
        library, about = "peft", f"A LoRA adapter for {source}, trained with pl_lowprec (PyTorch Lightning)."
        load = "from peft import AutoPeftModelForCausalLM\n\n"
        load += f"model = AutoPeftModelForCausalLM.from_pretrained({repo_id!r})"
    elif ggufs:
        library, about = None, f"GGUF files for llama.cpp and Ollama ({', '.join(ggufs)}), written by pl_lowprec."
        about += f" Base model: {source}."
        load = f"{DOWNLOAD_COMMAND} {repo_id} --local-dir model\nllama-cli -m model/{ggufs[0]}"
    else:
        library, about = "transformers", f"A LoRA fine-tune of {source}, merged into its weights by pl_lowprec."
        load = "from transformers import AutoModelForCausalLM\n\n"
        load += f"model = AutoModelForCausalLM.from_pretrained({repo_id!r})"
    tags = ["pl_lowprec", "lora", *(["gguf"] if ggufs else [])]
    data = ModelCardData(library_name=library, base_model=base_model, tags=tags)
    body = f"# {repo_id.split('/')[1]}\n\n{about}\n\n```{'python' if library else 'bash'}\n{load}\n```\n"
    return str(ModelCard(f"---\n{data.to_yaml()}\n---\n\n{body}"))


def push(directory: Path, repo_id: str, private: bool, pretrained: str | Path | None = None) -> str:
    """Write the model card, create the repository (if new: private with ``private``) and upload ``directory`` in one
    commit; the summary line names the repository."""
    from huggingface_hub import HfApi

    base_model = base_model_id(directory, pretrained)
    (directory / "README.md").write_text(model_card(directory, repo_id, base_model), encoding="utf-8")
    api = HfApi()
    try:
        api.create_repo(repo_id, private=private or None, exist_ok=True)
        commit = api.upload_folder(repo_id=repo_id, folder_path=directory, commit_message="Upload pl-lowprec export")
    except Exception as err:  # network, permissions, quota: the export is on disk either way
        raise ValueError(
            f"The export in {str(directory)!r} is complete, but uploading it to {repo_id!r} failed"
            f" ({briefly(err, 300)}). Upload the directory once that is fixed:"
            f" `{UPLOAD_COMMAND} {repo_id} {directory}`."
        ) from err
    base = f" (base_model: {base_model})" if base_model else ""
    line = f"Uploaded {directory} to https://huggingface.co/{repo_id}{base}: {commit.commit_url}"
    local = recorded_base(directory)
    if base_model is None and local is not None:
        line += (
            f". Its adapter_config.json names the base as {local!r}, a directory of this machine: others load it onto"
            f" their copy of that model, PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(BASE),"
            f" {repo_id!r}). A run fine-tuned from a hub id (model.pretrained: org/name) records the id instead."
        )
    return line
