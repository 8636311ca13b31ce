"""LoRA deltas merged into the original pretrained weights, written as a Hugging Face model directory.

Not the 4-bit weights the adapters trained on: a QLoRA fine-tune ends in the full-precision weights it started
from plus ``scale * B @ A``, as axolotl's and torchtune's merges do (and as peft's ``merge_and_unload`` would on an
unquantized base). The original safetensors are streamed file by file (one shard in memory at a time), each
adapted weight is merged in fp32 and rounded once to the output dtype, and every file keeps its name, keys and
order, so ``AutoModelForCausalLM.from_pretrained`` loads the result as it loaded the original. The other files of
the model directory (``config.json``, ``generation_config.json``, the tokenizer) are copied.

Dtype: by default each tensor keeps the dtype it has in the pretrained files (a bf16 checkpoint stays bf16; a
delta smaller than half a bf16 step of its weight is then rounded away, which ``dtype="float32"`` keeps).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from torch import nn

from pl_lowprec.adapters import lora_deltas
from pl_lowprec.loading import PretrainedWeights, resolve_checkpoint
from pl_lowprec.loading.sources import INDEX_NAME, open_safetensors
from pl_lowprec.transforms.dtypes import to_dtype

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")


def merge_into_pretrained(
    module: nn.Module, weights: PretrainedWeights, out_dir: Path, dtype: str | None = None
) -> dict[str, int]:
    """Write the merged model to ``out_dir`` (which must exist and be empty); return counts of merged/written."""
    from safetensors.torch import save_file

    cast = to_dtype(dtype) if dtype is not None else None
    source = Path(weights.path)
    _check_only_lora_trains(module)
    deltas = {f"{name}.weight": delta.cpu() for name, delta in lora_deltas(module).items()}
    index = resolve_checkpoint(source, weights.prefix)
    absent = sorted(set(deltas) - set(index.tensors))
    if absent:
        raise ValueError(
            f"These adapted weights are not in pretrained={str(source)!r}, so there is nothing to merge them into:"
            f" {', '.join(absent[:6])}. A weight tied to another (tie_word_embeddings) has no key of its own:"
            " leave that layer out of target_modules, or export an adapter directory instead."
        )
    by_file: dict[Path, dict[str, str]] = {}
    for module_key, info in index.tensors.items():
        by_file.setdefault(info.file, {})[info.key] = module_key
    sizes: dict[str, int] = {}
    merged = written = 0
    for file, keys in by_file.items():
        tensors: dict[str, torch.Tensor] = {}
        with open_safetensors(file, device="cpu") as handle:
            metadata = handle.metadata()
            for file_key in handle.keys():  # noqa: SIM118 - safe_open is not a Mapping
                tensor = handle.get_tensor(file_key)
                target = cast if cast is not None and tensor.is_floating_point() else tensor.dtype
                module_key = keys[file_key]
                if module_key in deltas:
                    tensor = tensor.float() + deltas[module_key]
                    merged += 1
                tensors[file_key] = tensor.to(target).contiguous()
                sizes[file_key] = tensors[file_key].numel() * tensors[file_key].element_size()
                written += 1
        save_file(tensors, str(out_dir / file.name), metadata=metadata or {"format": "pt"})
        del tensors
    if source.is_dir():
        _copy_model_files(source, out_dir, dtype)
        if (source / INDEX_NAME).is_file():
            index_json = json.loads((source / INDEX_NAME).read_text())
            index_json.setdefault("metadata", {})["total_size"] = sum(sizes.values())
            (out_dir / INDEX_NAME).write_text(json.dumps(index_json, indent=2, sort_keys=True) + "\n")
    return {"merged": merged, "tensors": written}


def _check_only_lora_trains(module: nn.Module) -> None:
    """A merge adds the LoRA deltas to the original weights; any other trained weight would be lost."""
    others = [n for n, p in module.named_parameters() if p.requires_grad and "lora_" not in n]
    if others:
        raise ValueError(
            f"Besides the LoRA adapters, {len(others)} weights were trained ({', '.join(others[:4])}), and a merge into"
            " the original weights would drop them. Export an adapter directory, or train with LoRA only"
            " (bias='none', no modules_to_save)."
        )


def _copy_model_files(source: Path, out_dir: Path, dtype: str | None) -> None:
    """Everything of the model directory but its weights (config, generation config, tokenizer, templates)."""
    for path in sorted(source.iterdir()):
        if path.is_file() and path.suffix not in WEIGHT_SUFFIXES and path.name != INDEX_NAME:
            shutil.copy(path, out_dir / path.name)
    config = out_dir / "config.json"
    if dtype is not None and config.is_file():
        fields = json.loads(config.read_text())
        key = "dtype" if "dtype" in fields or "torch_dtype" not in fields else "torch_dtype"
        fields[key] = str(to_dtype(dtype)).removeprefix("torch.")
        config.write_text(json.dumps(fields, indent=2, sort_keys=True) + "\n")
