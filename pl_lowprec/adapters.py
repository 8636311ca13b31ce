"""Adapter-only checkpoints and exports: what a fine-tune produced, without the frozen base it ran on.

- ``adapter_checkpoint_state_dict`` / ``load_trainable_state_dict``: the Lightning checkpoint holds only the
  trainable weights and the module's buffers (``trainable_state_dict`` is the weights alone); loading checks that
  exactly the frozen weights are missing, so a wrong checkpoint still fails, with ``CheckpointMismatch``: one
  paragraph (``mismatch_summary`` shortens torch's line per tensor).
- ``export_adapter``: a peft adapter directory (``adapter_config.json``, ``adapter_model.safetensors``) that
  ``peft.PeftModel.from_pretrained(base_model, directory)`` loads, with the heads and biases that trained whole.
- ``lora_deltas``: each LoRA layer's weight delta (``scale * B @ A``, peft's ``get_delta_weight``) in fp32, and
  ``lora_bias_deltas`` its bias delta where ``lora_bias=True`` gave B a bias (``scale * B.bias``, peft's merge).
- ``merged_state_dict``: base weights dequantized, LoRA deltas merged in, keys of the plain model. To merge into
  the original full-precision weights instead, see ``pl_lowprec.export.merged``.

Both also work on a model sharded by ``strategy="lowprec_fsdp"``: every rank must call them (they gather the
shards), and every rank gets the whole result.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping
from pathlib import Path

import torch
from torch import nn

from pl_lowprec._imports import import_peft
from pl_lowprec.distributed.mesh import full_tensor
from pl_lowprec.loading.key_match import slots
from pl_lowprec.transforms.conv1d import conv1d_weights, to_checkpoint_layout
from pl_lowprec.transforms.initial_adapters import (
    check_convertible,
    converted_config,
    convertible_init,
    with_initial_adapters,
)
from pl_lowprec.transforms.lora import ADAPTER_NAME, base_changing_init, is_within, lora_layers, trained_copies
from pl_lowprec.transforms.nf4 import dequantize_nf4, is_nf4
from pl_lowprec.transforms.quantization import is_quantized


def trainable_state_dict(module: nn.Module) -> dict[str, torch.Tensor]:
    trainable = {name for name, p in module.named_parameters() if p.requires_grad}
    return {k: v for k, v in module.state_dict().items() if k in trainable}


def persistent_buffer_names(module: nn.Module) -> set[str]:
    """The buffers ``module.state_dict()`` holds: a BatchNorm's running statistics, a step count or an EMA the
    module keeps. Training may change them, and no ``requires_grad`` says so."""
    return {key for key, slot in slots(module)[0].items() if not slot.is_param}


def adapter_checkpoint_keys(module: nn.Module) -> set[str]:
    """What an adapter-only checkpoint holds: the trainable weights and the persistent buffers, so that a
    resumed run starts from the running statistics the interrupted one had reached, not from their initial
    values (the frozen weights come back from their source)."""
    return {name for name, p in module.named_parameters() if p.requires_grad} | persistent_buffer_names(module)


def adapter_checkpoint_state_dict(module: nn.Module) -> dict[str, torch.Tensor]:
    kept = adapter_checkpoint_keys(module)
    return {k: v for k, v in module.state_dict().items() if k in kept}


class CheckpointMismatch(ValueError):
    """A checkpoint whose tensors do not fit the module, in one paragraph; ``summary`` says what differs."""

    def __init__(self, summary: str) -> None:
        super().__init__(
            f"The checkpoint does not fit the model this config builds: {summary}. It was trained on another model,"
            " or with other lora= or quantization= settings; resume with the config it was trained with (its run's"
            " config.yaml beside checkpoints/)."
        )
        self.summary = summary


_SIZE = re.compile(
    r"size mismatch for (?P<key>\S+): copying a param with shape torch\.Size\((?P<saved>\[[^\]]*\])\) from"
    r" checkpoint, the shape in current model is torch\.Size\((?P<model>\[[^\]]*\])\)"
)
_KEYS = re.compile(r"(?P<kind>Missing|Unexpected) key\(s\) in state_dict: (?P<keys>.*)")


def mismatch_summary(error: RuntimeError) -> str:
    """torch's ``load_state_dict`` error (a line per tensor: 85 lines for a model of another size) as one
    sentence: how many tensors differ in shape, with the first, and how many keys are missing or unexpected."""
    text = str(error)
    sizes = [m for line in text.splitlines() if (m := _SIZE.search(line))]
    parts = []
    if sizes:
        first = sizes[0]
        parts.append(
            f"{len(sizes)} tensors have other shapes (e.g. {first['key']}: {first['saved']} in the checkpoint,"
            f" {first['model']} in the model)"
        )
    for line in text.splitlines():
        found = _KEYS.search(line)
        if found:
            keys = re.findall(r'"([^"]+)"', found["keys"])
            parts.append(f"{len(keys)} {found['kind'].lower()} keys (e.g. {keys[0] if keys else '?'})")
    return "; ".join(parts) if parts else " ".join(text.split())


def load_trainable_state_dict(module: nn.Module, state_dict: Mapping[str, torch.Tensor], strict: bool = True) -> None:
    """Load a checkpoint that may hold only the trainable weights (and buffers, which older checkpoints lack); a
    trainable weight missing is an error. Keyed by
    tensor, not by module: under ``bias='lora_only'`` a LoRA layer's base holds a trainable bias and its frozen
    (quantized) weight, which the checkpoint leaves out."""
    result = module.load_state_dict(state_dict, strict=False)
    trainable = {name for name, p in module.named_parameters() if p.requires_grad}
    missing = [k for k in result.missing_keys if k in trainable]
    if strict and (result.unexpected_keys or missing):
        parts = [(result.unexpected_keys, "unexpected keys"), (missing, "missing trainable keys")]
        raise CheckpointMismatch(
            "; ".join(f"{len(keys)} {what} (e.g. {', '.join(keys[:3])})" for keys, what in parts if keys)
        )


def find_base_model(module: nn.Module) -> tuple[str, nn.Module]:
    """The submodule peft would wrap: the first Hugging Face ``PreTrainedModel`` inside, else ``module``."""
    for name, child in module.named_modules():
        if hasattr(child, "config") and hasattr(child, "save_pretrained") and name:
            return name, child
    return "", module


def held_hf_model(module: nn.Module) -> nn.Module | None:
    """The Hugging Face model ``module`` holds (``find_base_model``'s), or ``None`` where it holds none."""
    name, model = find_base_model(module)
    return model if name else None


def recorded_base(directory: str | Path) -> str | None:
    """The base model an adapter directory names (``adapter_config.json``'s ``base_model_name_or_path``, which
    ``export_adapter`` writes); None where there is no adapter config or it names none."""
    adapter_config = Path(directory) / "adapter_config.json"
    if not adapter_config.is_file():
        return None
    return json.loads(adapter_config.read_text()).get("base_model_name_or_path") or None


def is_causal_lm(model: nn.Module) -> bool:
    """Whether ``model`` is one of transformers' causal LM classes, whose adapter peft loads as ``CAUSAL_LM``
    (``AutoPeftModelForCausalLM`` cannot infer a class from an adapter without a task type)."""
    try:
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    except ImportError:
        return False
    return type(model).__name__ in set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values())


def export_adapter(
    module: nn.Module,
    directory: str | Path,
    base_model: str | None = None,
    base_model_name_or_path: str | None = None,
) -> Path:
    """Write a peft adapter directory for the LoRA layers under ``base_model`` (default: the HF model inside).

    ``base_model_name_or_path`` goes into ``adapter_config.json``: what ``AutoPeftModelForCausalLM`` loads."""
    import_peft()
    from safetensors.torch import save_file  # ships with peft

    prefix, base = (base_model, module.get_submodule(base_model)) if base_model else find_base_model(module)
    lead = f"{prefix}." if prefix else ""
    layers = {n.removeprefix(lead): m for n, m in lora_layers(module).items() if n.startswith(lead)}
    if not layers:
        raise ValueError(f"No LoRA layer found under {prefix or type(module).__name__!r}: nothing to export.")
    check_adapter_fits_base(module)
    peft_config = getattr(module, "peft_config", {}).get(ADAPTER_NAME)
    if peft_config is None:
        raise ValueError("The module has LoRA layers but no peft_config: was it injected by pl_lowprec?")
    names = sorted(layers)
    converted = conv1d_weights(module)
    initialised = convertible_init(module) is not None  # PiSSA, OLoRA: a LoRA of twice the rank, as peft converts
    if initialised:
        check_convertible(peft_config, layers)
        peft_config = converted_config(peft_config)
    exported = peft_config.__class__(
        **{**peft_config.to_dict(), "target_modules": "(?:" + "|".join(re.escape(n) for n in names) + ")"}
    )
    exported.inference_mode = True
    if any(f"{lead}{name}.weight" in converted for name in names):
        exported.fan_in_fan_out = True  # the base's layers are GPT-2's Conv1D, as peft expects them
    if base_model_name_or_path is not None:
        exported.base_model_name_or_path = base_model_name_or_path
    if exported.task_type is None and is_causal_lm(base):
        exported.task_type = "CAUSAL_LM"  # what AutoPeftModelForCausalLM reads; set at export, not in training
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    exported.save_pretrained(str(directory))
    marker = f".{ADAPTER_NAME}."
    tensors: dict[str, torch.Tensor] = {}
    for k, v in base.state_dict().items():
        if "lora_" in k and marker in k:
            tensor = full_tensor(v.detach()).cpu()
            if initialised:  # the layer's name is the key up to its LoRA part
                tensor = with_initial_adapters(k, tensor, layers[k.split(".lora_")[0]])
            tensors[f"base_model.model.{k}".replace(marker, ".")] = tensor.contiguous()
    copies = trained_copies(base)
    tensors |= {  # biases that trained (bias='lora_only' or 'all'), under the names peft saves them by
        f"base_model.model.{k}": full_tensor(v.detach()).cpu().contiguous()
        for k, v in base.named_parameters()
        if v.requires_grad and k.endswith(".bias") and "lora_" not in k and not any(is_within(k, c) for c in copies)
    }
    for name, wrapper in copies.items():  # modules_to_save: peft saves them under their own names
        own = wrapper.adapter_state_dict(ADAPTER_NAME, wrapper.state_dict())
        tensors |= {f"base_model.model.{name}.{k}": full_tensor(v.detach()).cpu().contiguous() for k, v in own.items()}
    save_file(tensors, str(directory / "adapter_model.safetensors"))
    return directory


def check_adapter_fits_base(model_or_lora_config: object) -> None:
    """An adapter directory loads onto the original base: refused where LoRA's initialization rewrote the base and
    no conversion to a plain LoRA is kept (PiSSA's and OLoRA's is: ``initial_adapters``)."""
    init = base_changing_init(model_or_lora_config)
    if init is not None and convertible_init(model_or_lora_config) is None:
        raise ValueError(
            f"lora init_lora_weights={init!r} rewrote the base weights when the adapters were added (part of each"
            " weight moved into A and B), so an adapter directory, which peft loads onto the original base, would"
            " compute something else than the trained model. Export the merged model (--merged: the base as"
            " trained plus the adapters), or train with init_lora_weights true, 'gaussian', 'pissa' or 'olora'"
            " (their adapters are converted for the original base)."
        )


def merged_state_dict(module: nn.Module, base_model: str | None = None) -> dict[str, torch.Tensor]:
    """The plain model's state dict: quantized weights dequantized, LoRA deltas merged, no adapter keys."""
    import_peft()
    prefix, base = (base_model, module.get_submodule(base_model)) if base_model else find_base_model(module)
    lead = f"{prefix}." if prefix else ""
    adapted = {n.removeprefix(lead): m for n, m in lora_layers(module).items() if n.startswith(lead)}
    quantized = {
        n: m
        for n, m in base.named_modules()
        if (is_quantized(m) or (isinstance(m, nn.Linear) and is_nf4(m.weight)))
        and not any(is_within(n, a) for a in adapted)
    }
    replaced = [*adapted, *quantized]
    merged = {
        k: full_tensor(v.detach())
        for k, v in base.state_dict().items()
        if not any(k.startswith(f"{n}.") for n in replaced)
    }
    deltas, bias_deltas = lora_deltas(base), lora_bias_deltas(base)
    check_biases_to_merge_into([n for n in bias_deltas if adapted[n].get_base_layer().bias is None])
    for name, layer in {**adapted, **quantized}.items():
        base_layer = layer.get_base_layer() if name in adapted else layer
        weight = dequantized_weight(base_layer)
        if name in deltas:
            weight = weight + deltas[name]
        merged[f"{name}.weight"] = weight
        if base_layer.bias is not None:
            merged[f"{name}.bias"] = full_tensor(base_layer.bias.detach()).float() + bias_deltas.get(name, 0)
    converted = {key.removeprefix(lead) for key in conv1d_weights(module) if key.startswith(lead)}
    return {key: to_checkpoint_layout(tensor, key, frozenset(converted)) for key, tensor in merged.items()}


def lora_deltas(module: nn.Module) -> dict[str, torch.Tensor]:
    """``{layer name: delta}``: what merging adds to each LoRA layer's base weight (its active adapters' sum), fp32.

    peft's ``get_delta_weight`` applies the scaling (``lora_alpha / r``, or rsLoRA's) and ``fan_in_fan_out``. DoRA
    rescales the merged weight's columns, which no delta expresses: it is refused."""

    def weight_delta(name: str, layer: nn.Module, adapter: str) -> torch.Tensor:
        if layer.use_dora.get(adapter, False):
            raise ValueError(
                f"{name} uses DoRA (use_dora=True), whose merge rescales the weight instead of adding a delta;"
                " export it as an adapter directory, or merge it with peft's merge_and_unload."
            )
        return full_tensor(layer.get_delta_weight(adapter)).float()

    return _summed_over_adapters(module, weight_delta)


def lora_bias_deltas(module: nn.Module) -> dict[str, torch.Tensor]:
    """``{layer name: delta}``: what merging adds to each LoRA layer's bias where ``lora_bias=True`` gave B a
    bias (``scaling * B.bias``, as peft's ``merge`` adds it), fp32."""

    def bias_delta(name: str, layer: nn.Module, adapter: str) -> torch.Tensor | None:
        if not layer.lora_bias.get(adapter, False):
            return None
        return full_tensor(layer.lora_B[adapter].bias.detach()).float() * layer.scaling[adapter]

    return _summed_over_adapters(module, bias_delta)


def _summed_over_adapters(
    module: nn.Module, delta_of: Callable[[str, nn.Module, str], torch.Tensor | None]
) -> dict[str, torch.Tensor]:
    """``{layer name: the sum of delta_of(name, layer, adapter)}`` over each LoRA layer's active adapters."""
    deltas: dict[str, torch.Tensor] = {}
    for name, layer in lora_layers(module).items():
        for adapter in layer.active_adapters:
            delta = delta_of(name, layer, adapter) if adapter in layer.lora_A else None
            if delta is not None:
                deltas[name] = deltas[name] + delta if name in deltas else delta
    return deltas


def check_biases_to_merge_into(names: list[str]) -> None:
    """Refuse a merge where ``lora_bias=True`` trained a bias on layers (``names``) whose base has none."""
    if names:
        raise ValueError(
            f"lora_bias=True trained a bias beside B on {len(names)} layers whose base layer has no bias (e.g."
            f" {', '.join(names[:3])}): a merged model has nowhere to hold it (peft's merge cannot either), and"
            " merging without it would drop part of what trained. Export the adapter directory instead (drop"
            " --merged: peft loads it with the biases), or train without lora_bias."
        )


def dequantized_weight(layer: nn.Module) -> torch.Tensor:
    """A linear layer's whole weight in fp32: bitsandbytes' and NF4 weights dequantized, FSDP2 shards gathered."""
    peft = import_peft()
    if is_quantized(layer):
        state = getattr(layer, "state", None)
        return peft.utils.integrations.dequantize_bnb_weight(layer.weight, state=state).float()
    if is_nf4(layer.weight):
        return dequantize_nf4(layer.weight.detach()).float()
    return full_tensor(layer.weight.detach()).float()
