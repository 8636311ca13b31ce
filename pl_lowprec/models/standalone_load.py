"""``CausalLM.load_from_checkpoint(path)``: Lightning builds the module and loads the checkpoint without a Trainer,
so without the strategy that quantized the base and added the LoRA adapters while training.

A checkpoint of a full model (no LoRA, or ``adapter_only_checkpoint=False`` without quantization) loads. Where it
holds every weight of the module, the pretrained files are not read: the model gets empty storage, which Lightning's
``load_state_dict`` fills from the checkpoint (streaming ``pretrained=`` first read every weight twice), and a
``pretrained=`` of ``config.json`` alone (the shapes) is enough. Where it holds fewer (saved without some, loaded
with ``strict=False``), the model is filled from ``pretrained=`` first, then Lightning loads the checkpoint over it.
One that holds tensors the plain model lacks (the strategy's adapter-only checkpoint: LoRA weights only; or
quantized weights) was refused by torch's missing/unexpected-key error, a line per tensor; it is refused here in
one paragraph that says what the checkpoint holds and how to load it.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

LORA_MARK = ".lora_"  # peft's lora_A / lora_B / lora_magnitude_vector / lora_embedding_A ...


def check_loads_without_strategy(module_keys: set[str], checkpoint: Mapping[str, Any], pretrained: Path) -> bool:
    """Refuse, in one paragraph, a checkpoint whose ``state_dict`` holds tensors the plain model lacks; else return
    whether it holds every key of the module (then nothing from ``pretrained=`` would survive its load)."""
    saved = list(checkpoint.get("state_dict", {}))
    foreign = [key for key in saved if key not in module_keys]
    if not foreign:
        return len(saved) == len(module_keys)  # every saved key is the module's, each once: the same set
    lora = [key for key in foreign if LORA_MARK in key]
    peft_only = all(LORA_MARK in key or ".modules_to_save." in key for key in foreign)
    adapter_only = bool(lora) and peft_only and len(saved) < len(module_keys)
    if adapter_only:
        what = (
            f"an adapter-only checkpoint (the strategy's adapter_only_checkpoint=True): its {len(saved)} tensors are"
            f" LoRA weights ({lora[0]}, ...), and the base model is not in it: it comes from pretrained="
            f"{str(pretrained)!r}, with the LoRA config of the strategy that trained it"
        )
    else:
        what = (
            f"a checkpoint of a model the strategy transformed: {len(foreign)} of its tensors are not in the plain"
            f" model ({', '.join(foreign[:2])}, ...), LoRA adapters or quantized weights"
        )
    raise ValueError(
        f"CausalLM.load_from_checkpoint got {what}. Lightning loads it without a Trainer, so without the strategy"
        " that adds the adapters (and quantizes the base) first. Fix: build the module and let the strategy restore"
        " it: Trainer(strategy=LowPrecisionStrategy(lora=..., quantization=... as trained)).validate(CausalLM("
        "pretrained), datamodule=..., ckpt_path=PATH) (or fit/test/predict with ckpt_path=); for a model to use"
        " elsewhere, `pl-lowprec export --ckpt_path PATH` writes the adapter (or the merged model) that peft and"
        " transformers load; `pl-lowprec generate --ckpt_path PATH` completes prompts with it."
    )
