"""A fine-tuned module restored from a run rebuilt from its config and one of its Lightning checkpoints.

The same path as resuming a fit: Lightning's ``configure_model`` hook runs under the strategy's and precision's
contexts, the strategy's ``ModelTransform`` loads the pretrained weights (quantizing as they stream in) and
injects the adapters, and the checkpoint's weights load into it. Nothing is trained; no process group is started,
so a DDP config restores in one process, and an FSDP config restores unsharded (the adapters are the same tensors
either way). The ``"auto"`` memory settings take the fastest side (``nothing_traded``): without a backward pass
checkpointing and the memory-saving paths save nothing. The run itself is rebuilt from its config by
``pl_lowprec.cli.rebuild``.

A checkpoint that holds every weight (no LoRA, or ``adapter_only_checkpoint=False``) fills empty storage and
``pretrained=`` is not streamed (``transforms/checkpoint_fills.py``), as in ``validate(ckpt_path=)``: for a merge
only its headers are read, for the key prefix the merge writes the original files' keys with; an adapter export
reads nothing of them. The merge itself still reads the original files: it writes the full-precision weights the
adapters trained on (which a QLoRA checkpoint holds in 4 bits, and a run that kept its frozen weights in the compute
dtype holds rounded), in their files, keys and dtypes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.trainer.call import _call_configure_model
from torch import nn

from pl_lowprec.adapters import CheckpointMismatch, adapter_checkpoint_keys, held_hf_model
from pl_lowprec.loading import PretrainedWeights
from pl_lowprec.loading.key_match import fitting_index
from pl_lowprec.loading.sources import weight_files
from pl_lowprec.memory.fastest import nothing_traded
from pl_lowprec.transforms.lora import has_lora
from pl_lowprec.transforms.pipeline import ModelTransform


@dataclass
class Restored:
    """The trained module on its device, in eval mode, and where its original weights came from."""

    module: nn.Module
    trainer: Any
    transform: ModelTransform
    weights: PretrainedWeights | None
    checkpoint: Path
    tokenizer_dir: str | None
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)  # the data's, for generate's chat prompts

    @property
    def hf_model(self) -> nn.Module | None:
        """The Hugging Face ``PreTrainedModel`` inside the module (what ``generate`` runs on), if there is one."""
        return held_hf_model(self.module)


def restore(
    checkpoint: str | Path, trainer: Any, module: nn.Module, datamodule: Any = None, merge: bool = True
) -> Restored:
    """``module`` with the weights of ``checkpoint``, through ``trainer``'s strategy and precision as in a fit.

    ``trainer``, ``module`` and ``datamodule`` are a run rebuilt from its config (``pl_lowprec.cli.rebuild``).
    ``merge``: whether the restored module may be merged into the original files (``--merged``, GGUF), whose key
    prefix a whole checkpoint's restore then reads from their headers; an adapter export and ``generate`` pass
    ``False`` and read nothing of them."""
    checkpoint = Path(checkpoint)
    if not checkpoint.is_file():
        raise FileNotFoundError(f"Checkpoint {str(checkpoint)!r} does not exist (a Lightning .ckpt file).")
    transform = strategy_transform(trainer)
    config = nothing_traded(transform.config)  # nothing trains here, so "auto" takes the fastest settings
    if transform.sharding is not None or config is not transform.config:  # unsharded, in this one process
        transform = ModelTransform(config)
    state = trainer.strategy.load_checkpoint(checkpoint)
    if not isinstance(state, dict) or "state_dict" not in state:
        raise ValueError(f"{str(checkpoint)!r} is not a Lightning checkpoint: it has no 'state_dict'.")
    trainer.strategy.connect(module)
    module.trainer = trainer
    _call_configure_model(trainer)
    device = trainer.strategy.root_device
    state_dict = state["state_dict"]
    # before the transform renames keys; only a merge writes the original files' keys
    merge_base = base_of_a_whole_checkpoint(module, transform, state_dict) if merge else None
    transform.apply(module, trainer.precision_plugin, device, restored_next=state_dict)
    if not has_lora(module) and config.qat is None:  # a QAT run exports its converted model (export/quantized.py)
        raise ValueError(
            "The config trains no LoRA adapters (the strategy has no lora=), so there is nothing to export or"
            " merge. Pass the config the checkpoint was trained with."
        )
    _load(module, transform, state_dict, checkpoint)
    module = trainer.precision_plugin.convert_module(module)
    module.to(device).eval()
    tokenizer = getattr(datamodule, "tokenizer_dir", None) if datamodule is not None else None
    template_kwargs = dict(getattr(datamodule, "chat_template_kwargs", None) or {})
    weights = merge_base or transform.weights_for(module)
    return Restored(module, trainer, transform, weights, checkpoint, tokenizer, template_kwargs)


def base_of_a_whole_checkpoint(
    module: nn.Module, transform: ModelTransform, state_dict: Mapping[str, torch.Tensor]
) -> PretrainedWeights | None:
    """Where ``state_dict`` sets every weight of ``module`` (built on the meta device, not transformed yet), so that
    ``transform`` reads nothing of ``pretrained=``: its weights with the key prefix a streamed load would have taken
    (``key_match.fitting_index``, headers only), which a merge writes the original keys with. ``None`` otherwise:
    the load takes the prefix."""
    weights = transform.weights_the_checkpoint_replaces(module, state_dict)
    if weights is None:
        return None
    if weights.prefix is not None:
        return weights
    with weight_files() as files:
        _, _, prefix = fitting_index(
            module, weights.path, None, transform.new_heads, weights.expected_prefix, files=files
        )
    return dataclasses.replace(weights, prefix=prefix)


def strategy_transform(trainer: Any) -> ModelTransform:
    """The config's strategy's ``ModelTransform``; an error when the strategy is not pl_lowprec's."""
    transform = getattr(trainer.strategy, "transform", None)
    if not isinstance(transform, ModelTransform):
        raise ValueError(
            f"The config's strategy is {type(trainer.strategy).__name__}, not a pl_lowprec strategy: there is no"
            " lora= to export. Use the config the checkpoint was trained with."
        )
    return transform


def sources(trainer: Any, module: nn.Module, datamodule: Any = None) -> tuple[PretrainedWeights | None, str | None]:
    """Where ``restore`` will read the original weights and the tokenizer from, known before anything loads."""
    weights = strategy_transform(trainer).weights_for(module)
    return weights, getattr(datamodule, "tokenizer_dir", None) if datamodule is not None else None


def _load(module: nn.Module, transform: ModelTransform, state_dict: dict[str, torch.Tensor], path: Path) -> None:
    """Adapter-only or full, whichever the checkpoint holds; a mismatch names the checkpoint and the config."""
    if not any("lora_" in key for key in state_dict) and transform.config.qat is None:
        raise ValueError(
            f"{str(path)!r} holds no LoRA weights ({len(state_dict)} tensors, e.g. {sorted(state_dict)[:3]}): it was"
            " not written by a run with lora=, so there are no adapters to export."
        )
    adapter_only = set(state_dict) <= adapter_checkpoint_keys(module)
    try:
        as_saved = dataclasses.replace(transform.config, adapter_only_checkpoint=adapter_only)
        ModelTransform(as_saved).load_state_dict(module, state_dict, strict=True)
    except CheckpointMismatch as err:
        raise ValueError(
            f"{str(path)!r} does not fit the module built from the config: {err.summary}. Pass"
            " the config it was trained with (lora= rank and target_modules, quantization=, the model and its"
            " pretrained weights)."
        ) from err
