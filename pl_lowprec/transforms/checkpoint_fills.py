"""A checkpoint restored next that holds every weight: the pretrained files need not be read.

``fit``/``validate``/``test``/``predict`` with ``ckpt_path=`` run the strategy's transform and then load the
checkpoint over the model. A checkpoint of the whole model (no LoRA, or ``adapter_only_checkpoint=False``) then
overwrites every weight ``pretrained=`` streamed in: each was read twice, the pretrained one for nothing. Where
it holds every one, the model gets empty storage instead, the transform runs on it as on loaded weights
(LoRA, QAT, FP8), and the checkpoint's load fills each value, as ``CausalLM.load_from_checkpoint`` does
(``models/standalone_load.py``). A LoRA initialization computed from the base (PiSSA, OLoRA, ...: it moves part of
the base into A and B, and keeps the initial A and B for the export) reads the pretrained weights as before.
With ``quantization=`` the layers are quantized from that empty storage, and the checkpoint's load replaces what
it made: each 4-bit weight with its saved bytes and constants (``quantized_checkpoint.py``), each int8 weight
with its saved bytes and ``SCB``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import nn

from pl_lowprec.loading.empty import is_meta
from pl_lowprec.transforms.lora import plain_key

INITS_FROM_NOTHING = (True, False, "gaussian", "orthogonal")  # peft's LoRA inits that never look at the base


def fills_every_weight(model: nn.Module, config: Any, state_dict: Mapping[str, Any]) -> bool:
    """Whether loading ``state_dict`` after the transform of ``config`` sets every parameter ``model`` still has
    on the meta device: then nothing read from ``pretrained=`` would survive."""
    if config.adapter_only or (config.lora is not None and config.lora.init_lora_weights not in INITS_FROM_NOTHING):
        return False
    waiting = [name for name, param in model.named_parameters() if is_meta(param)]
    saved = {plain_key(key) for key in state_dict}
    return bool(waiting) and all(name in saved for name in waiting)
