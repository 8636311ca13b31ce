"""LoRA deltas merged into the original pretrained weights, written as a Hugging Face model directory.

Not the 4-bit weights the adapters trained on: a QLoRA fine-tune ends in the full-precision weights it started
from plus ``scale * B @ A``, as axolotl's and torchtune's merges do (and as peft's ``merge_and_unload`` would on an
unquantized base). The original safetensors are streamed file by file (one shard in memory at a time), each
adapted weight is merged in fp32 and rounded once to the output dtype, and every file keeps its name, keys and
order, so ``AutoModelForCausalLM.from_pretrained`` loads the result as it loaded the original; a base of
``pytorch_model.bin`` files is unpickled once per shard, as the streamed load reads it (``loading.sources.WeightFiles``:
headers and tensors from the one mapping, each tensor's pages dropped once written; ``pl-lowprec export`` shares
the mapping with the restore's load, ``sources.weight_files``), and written as safetensors
(``pytorch_model-00001-of-00002.bin`` as ``model-00001-of-00002.safetensors``, with ``model.safetensors.index.json``),
as ``save_pretrained`` writes it.
The other files of the model directory (``config.json``, ``generation_config.json``, the tokenizer) are copied.

Weights trained whole (a task's head in LoRA's ``modules_to_save``, biases under ``bias='all'``) are written as
they trained, replacing the original tensor, or added where the checkpoint had none (a classifier's new
``score``), as peft's ``merge_and_unload`` leaves them. A head the module does not have (a causal LM's
``lm_head`` under a classifier) is left out, and ``config.json`` names the module's class (``architectures``)
and its labels, so ``AutoModelForSequenceClassification.from_pretrained`` loads the result as the module was.

B's bias (``lora_bias=True``) is added, scaled, to the layer's bias as trained, as peft's merge adds it; a layer
without a bias has nowhere to hold it, and the merge is refused.

Where the adapters' initialization rewrote the base (``init_lora_weights`` PiSSA, OLoRA),
the deltas go onto the base as trained (the residual), which the original files do not hold.

Dtype: by default each tensor keeps the dtype it has in the pretrained files (a bf16 checkpoint stays bf16; a
delta smaller than half a bf16 step of its weight is then rounded away, which ``dtype="float32"`` keeps); a new
head takes the files' floating dtype.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch
from torch import nn

from pl_lowprec.adapters import (
    check_biases_to_merge_into,
    dequantized_weight,
    find_base_model,
    lora_bias_deltas,
    lora_deltas,
)
from pl_lowprec.export.trained_whole import file_key_of, trained_whole, untied_heads, without_absent_modules
from pl_lowprec.loading import PretrainedWeights, resolve_checkpoint
from pl_lowprec.loading.sources import INDEX_NAME, WeightFiles, weight_files
from pl_lowprec.loading.torch_files import BIN_INDEX_NAME
from pl_lowprec.transforms.conv1d import conv1d_weights
from pl_lowprec.transforms.dtypes import to_dtype
from pl_lowprec.transforms.lora import base_changing_init, lora_layers

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
LABEL_FIELDS = ("id2label", "label2id", "problem_type", "pad_token_id")  # a classifier's, beside its class


def merge_into_pretrained(
    module: nn.Module, weights: PretrainedWeights, out_dir: Path, dtype: str | None = None
) -> dict[str, int]:
    """Write the merged model to ``out_dir`` (which must exist and be empty); return how many tensors were
    ``merged`` (LoRA), written ``whole`` as they trained, ``left_out`` (heads the module lacks), ``tensors`` in all."""
    with weight_files() as files:  # a .bin shard is unpickled once: headers, tensors (and the restore's load)
        return _write_merged(module, weights, out_dir, dtype, files)


def _write_merged(
    module: nn.Module, weights: PretrainedWeights, out_dir: Path, dtype: str | None, files: WeightFiles
) -> dict[str, int]:
    from safetensors.torch import save_file

    cast = to_dtype(dtype) if dtype is not None else None
    source = Path(weights.path)
    deltas = {f"{name}.weight": delta.cpu() for name, delta in lora_deltas(module).items()}
    bias_deltas = {f"{name}.bias": delta.cpu() for name, delta in lora_bias_deltas(module).items()}
    index = resolve_checkpoint(source, weights.prefix, files=files)
    check_biases_to_merge_into([key.removesuffix(".bias") for key in bias_deltas if key not in index.tensors])
    deltas |= bias_deltas
    absent = sorted(set(deltas) - set(index.tensors))
    if absent:
        raise ValueError(
            f"These adapted weights are not in pretrained={str(source)!r}, so there is nothing to merge them into:"
            f" {', '.join(absent[:6])}. A weight tied to another (tie_word_embeddings) has no key of its own:"
            " leave that layer out of target_modules, or export an adapter directory instead."
        )
    residuals, converted = residual_bases(module), conv1d_weights(module)
    untied = {key: weight for key, weight in untied_heads(module).items() if key not in index.tensors}  # tied: no key
    whole = untied | trained_whole(module)
    new_keys = {file_key_of(key, weights.prefix, source): key for key in whole if key not in index.tensors}
    kept = without_absent_modules(module, index.tensors)
    by_file: dict[Path, dict[str, str]] = {}
    for module_key, info in index.tensors.items():
        by_file.setdefault(info.file, {})[info.key] = module_key if module_key in kept else ""
    sizes: dict[str, int] = {}
    merged = written = replaced = 0
    floating = torch.float32
    for position, (file, keys) in enumerate(by_file.items()):
        tensors: dict[str, torch.Tensor] = {}
        with files.open(file, device="cpu") as handle:
            metadata = handle.metadata()
            for file_key in handle.keys():  # noqa: SIM118 - safe_open is not a Mapping
                module_key = keys.get(file_key, "")
                if not module_key:
                    continue  # a head the module does not have (a causal LM's lm_head under a classifier)
                tensor = handle.get_tensor(file_key)
                floating = tensor.dtype if tensor.is_floating_point() else floating
                target = cast if cast is not None and tensor.is_floating_point() else tensor.dtype
                flip = module_key in converted  # a GPT-2 Conv1D's weight: the file holds it transposed
                if module_key in deltas:  # onto the base as trained: a residual, or a bias trained whole
                    base = whole.get(module_key, residuals.get(module_key, tensor.T if flip else tensor))
                    tensor = base.float() + deltas[module_key]
                    tensor, merged = (tensor.T if flip else tensor), merged + 1
                elif module_key in whole:
                    tensor, replaced = (whole[module_key].T if flip else whole[module_key]), replaced + 1
                tensor = tensor.to(target).contiguous()
                if _same_memory(tensor, tensors.values()):
                    continue  # a tied weight that torch.save wrote under both keys: saved once, as save_pretrained does
                tensors[file_key] = tensor
        if position == len(by_file) - 1:  # new heads go into the last file, as save_pretrained puts the head last
            tensors |= {k: whole[m].to(cast or floating).contiguous() for k, m in new_keys.items()}
        sizes |= {k: t.numel() * t.element_size() for k, t in tensors.items()}
        written += len(tensors)
        save_file(tensors, str(out_dir / written_name(file.name)), metadata=metadata or {"format": "pt"})
        del tensors
        for file_key in keys:  # written: a kept .bin mapping gives back the pages read from it
            files.release(file, file_key)
    if source.is_dir():
        _copy_model_files(source, out_dir)
        _describe_the_trained_model(module, out_dir, set(new_keys), dtype)
        read_as = INDEX_NAME if next(iter(by_file)).suffix == ".safetensors" else BIN_INDEX_NAME  # the one read
        source_index = source / read_as
        if source_index.is_file():
            index_json = json.loads(source_index.read_text())
            index_json.setdefault("metadata", {})["total_size"] = sum(sizes.values())
            last_file = written_name(list(by_file)[-1].name)
            weight_map = index_json.get("weight_map", {})
            kept_map = {k: written_name(f) for k, f in weight_map.items() if k in sizes}
            index_json["weight_map"] = kept_map | dict.fromkeys(new_keys, last_file)
            (out_dir / INDEX_NAME).write_text(json.dumps(index_json, indent=2, sort_keys=True) + "\n")
    left_out = len(index.tensors) - len(kept)
    return {"merged": merged, "tensors": written, "whole": replaced + len(new_keys), "left_out": left_out}


def _same_memory(tensor: torch.Tensor, written: Any) -> bool:
    """``tensor`` is a tensor already written, under another key: a ``pytorch_model.bin`` of a tied model holds
    ``lm_head.weight`` and the embedding as one storage, which safetensors refuses to save twice."""
    if tensor.numel() == 0:
        return False
    where = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tensor.shape, tensor.dtype)
    return any((t.untyped_storage().data_ptr(), t.storage_offset(), t.shape, t.dtype) == where for t in written)


def written_name(name: str) -> str:
    """The merged file's name for a file of the base: a safetensors name as it is; ``pytorch_model*.bin`` (or any
    torch file) as the safetensors name ``save_pretrained`` gives it (``model-00001-of-00002.safetensors``)."""
    path = Path(name)
    if path.suffix == ".safetensors":
        return name
    stem = path.stem
    return ("model" + stem.removeprefix("pytorch_model") if stem.startswith("pytorch_model") else stem) + ".safetensors"


def residual_bases(module: nn.Module) -> dict[str, torch.Tensor]:
    """``{weight key: base weight as trained}`` where the adapters' initialization rewrote the base (PiSSA, OLoRA,
    ...: the base holds the residual, A and B the rest): the merge adds the deltas to it, not to the original
    file's weight, which would count the moved part twice. A quantized residual is dequantized: the merged model
    then computes what the trained one did. Empty for every other initialization."""
    if base_changing_init(module) is None:
        return {}
    return {
        f"{name}.weight": dequantized_weight(layer.get_base_layer()).cpu()
        for name, layer in lora_layers(module).items()
    }


def _describe_the_trained_model(module: nn.Module, out_dir: Path, new_keys: set[str], dtype: str | None) -> None:
    """``config.json`` for the model as written, where it differs from the pretrained one: the ``dtype`` of
    ``--dtype``; a causal LM's checkpoint
    merged into a classifier names the class (``architectures``) and its labels; an output head trained whole
    (``modules_to_save=["lm_head"]``) under tied embeddings, or left with the original rows where the input
    embeddings trained whole, has its own tensor, so ``tie_word_embeddings`` is false (transformers would otherwise
    tie it back, or warn and untie)."""
    base, config = find_base_model(module)[1], out_dir / "config.json"  # the module itself, if it is the model
    if not config.is_file():
        return
    fields = json.loads(config.read_text())
    before = dict(fields)
    library_class = type(base).__module__.startswith("transformers.") and hasattr(base, "config")
    if library_class and fields.get("architectures") != [type(base).__name__]:
        own = base.config.to_dict()
        fields["architectures"] = [type(base).__name__]
        fields |= {key: own[key] for key in LABEL_FIELDS if own.get(key) is not None}
    heads = getattr(base, "get_output_embeddings", lambda: None)()
    names = [name for name, m in base.named_modules() if m is heads] if heads is not None else []
    if fields.get("tie_word_embeddings") and names and f"{names[0]}.weight" in new_keys:
        fields["tie_word_embeddings"] = False
    if dtype is not None:  # the dtype the weights were written in
        key = "dtype" if "dtype" in fields or "torch_dtype" not in fields else "torch_dtype"
        fields[key] = str(to_dtype(dtype)).removeprefix("torch.")
    if fields != before:
        config.write_text(json.dumps(fields, indent=2, sort_keys=True) + "\n")


def _copy_model_files(source: Path, out_dir: Path) -> None:
    """Everything of the model directory but its weights (config, generation config, tokenizer, templates)."""
    for path in sorted(source.iterdir()):
        if path.is_file() and path.suffix not in WEIGHT_SUFFIXES and path.name not in (INDEX_NAME, BIN_INDEX_NAME):
            shutil.copy(path, out_dir / path.name)
