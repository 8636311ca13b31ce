"""Tiny pretrained checkpoints written with ``save_pretrained`` for the loading tests (no downloads)."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

import lightning.pytorch as pl
import torch


def llama_config(hidden_size: int = 64, layers: int = 2, tie: bool = False, vocab_size: int = 256, **kwargs):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=hidden_size * 3,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=64,
        tie_word_embeddings=tie,
        **kwargs,
    )


class LlamaModule(pl.LightningModule):
    """A LightningModule of the user's own kind: a Hugging Face Llama (``llama_config(**config_kwargs)``) as
    ``self.model``, its loss on ``input_ids``, AdamW on what trains."""

    def __init__(self, **config_kwargs) -> None:
        super().__init__()
        from transformers import LlamaForCausalLM

        self.model = LlamaForCausalLM(llama_config(**config_kwargs))

    def training_step(self, batch, batch_idx):
        return self.model(input_ids=batch["input_ids"], labels=batch["input_ids"]).loss

    def configure_optimizers(self):
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=1e-2)


LLAMA_LORA = {"r": 4, "target_modules": ["q_proj", "v_proj"]}  # LoRA for ``LlamaModule``'s attention


class ValidatedLlama(LlamaModule):
    """``LlamaModule`` that logs ``val_loss``: what ``validate(ckpt_path=)`` of a restored run gives."""

    def validation_step(self, batch, batch_idx):
        loss = self.model(input_ids=batch["input_ids"], labels=batch["input_ids"]).loss
        self.log("val_loss", loss)


def save_llama(
    directory: Path,
    seed: int = 1,
    max_shard_size: str | None = None,
    dtype: torch.dtype = torch.float32,
    **config_kwargs,
) -> Path:
    """A Llama with seeded random weights saved as a Hugging Face directory (sharded if ``max_shard_size``)."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(llama_config(**config_kwargs)).to(dtype)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(directory, **kwargs)
    return directory


def save_tokenizer(directory: Path, vocab_size: int = 320) -> Path:
    """A BPE tokenizer trained on a slice of the standard library, with a chat template, saved to ``directory``."""
    from pl_lowprec.demo.stdlib_text import stdlib_bytes
    from pl_lowprec.demo.tokenizer import train_tokenizer

    tokenizer = train_tokenizer([stdlib_bytes(100_000).decode("utf-8", "replace")], vocab_size)
    tokenizer.save_pretrained(directory)
    return directory


def save_with_template(tokenizer_dir: Path | str, template: str | dict[str, str] | None, directory: Path) -> str:
    """The tokenizer of ``tokenizer_dir`` with ``template`` as its chat template, saved to ``directory`` (which may
    be ``tokenizer_dir`` itself): what the user's ``--data.tokenizer`` would hold."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    tokenizer.chat_template = template
    tokenizer.save_pretrained(directory)
    return str(directory)


def save_pretrained_dir(directory: Path, hidden_size: int = 32, layers: int = 1, tie: bool = False) -> Path:
    """A Hugging Face model directory as from the hub: tokenizer and Llama weights of matching vocabulary
    (``tie``: the head shares the embedding, as SmolLM2's does)."""
    tokenizer = save_tokenizer(directory)
    from transformers import AutoTokenizer

    vocab = len(AutoTokenizer.from_pretrained(tokenizer))
    return save_llama(directory, hidden_size=hidden_size, layers=layers, vocab_size=vocab, tie=tie)


def causal_lm_fit_args(pretrained: Path, data: Path, tokenizer: Path | None = None) -> list[str]:
    """``pl-lowprec fit`` on the user's path: CausalLM + TextDataModule, fp32 on the CPU, no validation."""
    return [
        "fit",
        "--model=pl_lowprec.models.CausalLM",
        f"--model.pretrained={pretrained}",
        "--data=pl_lowprec.data.TextDataModule",
        f"--data.train_files={data}",
        f"--data.tokenizer={tokenizer or pretrained}",
        "--data.batch_size=4",
        "--data.val_fraction=0",
        "--trainer.accelerator=cpu",
        "--trainer.precision=32-true",
        "--trainer.limit_val_batches=0",
        "--trainer.enable_progress_bar=false",
        "--trainer.enable_model_summary=false",
    ]


def write_prompt_completion(path: Path, n: int = 40) -> Path:
    import json

    rows = [{"prompt": f"def f{i}(x):\n    return", "completion": f" x + {i}"} for i in range(n)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def stand_in_hub(monkeypatch, cache: Path, repos: dict[str, Path]) -> None:
    """``huggingface_hub.snapshot_download`` for ``repos`` (hub id -> directory), with no network: it copies the
    files that ``allow_patterns`` selects into ``cache``, as the real download keeps only those; any other id fails
    as it would offline."""
    import shutil

    import huggingface_hub
    from huggingface_hub.utils import filter_repo_objects

    def download(repo_id: str, allow_patterns=None, **kwargs) -> str:
        if repo_id not in repos:
            raise ConnectionError(f"no network: {repo_id} is not in the stand-in hub")
        source = repos[repo_id]
        target = cache / f"models--{repo_id.replace('/', '--')}" / "snapshots" / "0123abc"  # huggingface_hub's layout
        names = [p.relative_to(source).as_posix() for p in source.rglob("*") if p.is_file()]
        for name in filter_repo_objects(names, allow_patterns=allow_patterns):
            (target / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(source / name, target / name)
        return str(target)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", download)


def rewrite_weights(directory: Path, edit: Callable[[dict], dict], copy_to: Path | None = None) -> Path:
    """The checkpoint with its ``model.safetensors`` rewritten by ``edit`` (a state dict in, one out), in place or in
    a copy of the directory at ``copy_to``: what a damaged or differently saved checkpoint holds."""
    from safetensors.torch import load_file, save_file

    if copy_to is not None:
        shutil.copytree(directory, copy_to)
        directory = copy_to
    weights = directory / "model.safetensors"
    save_file(edit(load_file(weights)), weights, metadata={"format": "pt"})
    return directory


def count_unpickles(monkeypatch) -> list:
    """Every file ``torch.load`` opens from now on (each unpickles a whole .bin shard's pickle): a .bin read once
    per load shows each shard here once."""
    loads = []
    real_load = torch.load
    monkeypatch.setattr(torch, "load", lambda file, *args, **kw: loads.append(file) or real_load(file, *args, **kw))
    return loads


def count_safetensors_opens(monkeypatch, directory: Path) -> list[str]:
    """The names of the files in ``directory`` that ``safetensors.safe_open`` opens from now on (a streamed load
    opens each for its headers and again for each module's tensors)."""
    import safetensors

    opened = []
    real_open = safetensors.safe_open

    def counting(file, *args, **kwargs):
        if Path(file).parent == Path(directory):
            opened.append(Path(file).name)
        return real_open(file, *args, **kwargs)

    monkeypatch.setattr(safetensors, "safe_open", counting)
    return opened


def bin_copy(directory: Path, copy_to: Path, shards: int = 1, tied_key: bool = False) -> Path:
    """The model directory with its weights as transformers < 5 saved them without safetensors: one
    ``pytorch_model.bin``, or ``shards`` files ``pytorch_model-0000i-of-0000n.bin`` and
    ``pytorch_model.bin.index.json``.
    ``tied_key``: ``lm_head.weight`` saved too, sharing the embedding's storage (as ``torch.save`` of a tied
    ``state_dict`` writes it)."""
    import json

    import torch
    from safetensors.torch import load_file

    shutil.copytree(directory, copy_to, ignore=shutil.ignore_patterns("*.safetensors", "model.safetensors.index.json"))
    state: dict[str, torch.Tensor] = {}
    for file in sorted(directory.glob("*.safetensors")):
        state |= load_file(file)
    if tied_key:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    if shards == 1:
        torch.save(state, copy_to / "pytorch_model.bin")
        return copy_to
    keys = list(state)
    weight_map = {}
    for i in range(shards):
        name = f"pytorch_model-{i + 1:05d}-of-{shards:05d}.bin"
        part = keys[i * len(keys) // shards : (i + 1) * len(keys) // shards]
        torch.save({k: state[k] for k in part}, copy_to / name)
        weight_map |= dict.fromkeys(part, name)
    total = sum(t.numel() * t.element_size() for t in state.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (copy_to / "pytorch_model.bin.index.json").write_text(json.dumps(index, indent=2))
    return copy_to
