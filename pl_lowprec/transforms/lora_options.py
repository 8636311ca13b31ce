"""The ``LoraConfig`` options the strategy runs as peft means them; the others are refused when it is built.

The strategy adds LoRA with peft's ``inject_adapter_in_model`` into the user's module, not with ``get_peft_model``
and its ``PeftModel``. Options that only those apply would be ignored in silence (``layer_replication``,
``ensure_weight_tying``, aLoRA's ``alora_invocation_tokens``, which ``PeftModel.forward`` reads) or fail inside peft
(``trainable_token_indices``, which looks for ``get_input_embeddings`` on the module). ``target_parameters`` is not
resolved: the strategy names LoRA's targets as linear layers.

Some inits are left by peft to its caller, and peft's fallbacks without them are silent or late:
- Data-driven inits need a pass over training batches that the caller runs: EVA after the adapters are added
  (``initialize_lora_eva_weights``), CorDA and LoRA-GA before (``preprocess_corda``, ``preprocess_loraga``).
  Without it, EVA and LoRA-GA train plain LoRA under their names, and CorDA stops once the weights have loaded.
- LoftQ quantizes each full-precision weight itself, on a CUDA device (a traceback on a CPU), for a model saved
  and loaded again in 4-bit.
The strategy runs none of these, so they are refused. Inits that compute from the base weight in its dtype cannot
run on bitsandbytes' packed 4-bit or int8 storage: PiSSA and MiCA stop after the weights load with peft's message,
orthogonal with a traceback (its A and B take the packed dtype). OLoRA dequantizes, so it runs.
"""

from __future__ import annotations

from typing import Any

from pl_lowprec.transforms.lora import lora_init_among

NOT_RUN = {
    "eva": "EVA sets A from the SVD of layer inputs over training batches (peft's initialize_lora_eva_weights, run"
    " by the caller after the adapters are added); without it peft leaves A at its default init: plain LoRA under"
    " EVA's name",
    "lora_ga": "LoRA-GA starts from gradients over training batches (peft's preprocess_loraga, run by the caller"
    " before the adapters are added); without them peft falls back to the default init in silence",
    "corda": "CorDA starts from the covariance of layer inputs over training batches (peft's preprocess_corda, run"
    " by the caller before the adapters are added); without it peft stops once the weights have loaded",
    "loftq": "LoftQ quantizes each full-precision weight itself, on a CUDA device, and rewrites the base to the"
    " dequantized values, for a model saved and loaded again in 4-bit; the strategy quantizes the weights as they"
    " stream in",
}
PEFT_MODEL_ONLY = (
    "is applied by peft's get_peft_model or PeftModel, not by the injection of LoRA into your module (peft's"
    " inject_adapter_in_model) that the strategy runs, where it would be ignored or fail inside peft."
)
NOT_INJECTED = {  # field: (why, fix)
    "inference_mode": (
        "freezes the adapters (peft's setting for loading an adapter to run it), so nothing would train: the first"
        " step stopped in a traceback (an empty optimizer, or a loss without gradients). A LoraConfig read from a"
        " saved adapter directory (LoraConfig.from_pretrained) has it set.",
        "inference_mode: false.",
    ),
    "trainable_token_indices": (
        PEFT_MODEL_ONLY,
        "modules_to_save: [embed_tokens] trains the whole input embedding, and a merged export writes it as trained.",
    ),
    "layer_replication": (
        PEFT_MODEL_ONLY,
        "replicate the layers in your model before training (its config's num_hidden_layers and weights).",
    ),
    "ensure_weight_tying": (
        PEFT_MODEL_ONLY,
        "leave it out: a head tied to a module trained whole keeps the original rows, which the LoRA line names and"
        " a merged export writes as its own tensor; or add the head to modules_to_save too.",
    ),
    "alora_invocation_tokens": (
        PEFT_MODEL_ONLY,
        "leave it out to train plain LoRA on every token; aLoRA needs peft's PeftModel, whose forward finds the"
        " invocation tokens.",
    ),
    "target_parameters": (
        "is not run by the strategy, which resolves LoRA's targets to linear layers by name (target_modules).",
        "name the linear layers in target_modules; LoRA on bare parameters (MoE experts) is not injected.",
    ),
}
FLOAT_BASE = ("pissa", "mica", "orthogonal")  # pissa_niter_N too
FROM_WHOLE_WEIGHT = ("pissa", "olora", "mica")  # an SVD or QR of each base weight as LoRA is added
ALLOWED = "True (peft's default), 'gaussian', 'pissa', 'pissa_niter_N', 'olora', 'orthogonal', 'mica' or False"
ON_QUANTIZED = "True (peft's default: A random, B zero), 'gaussian', 'olora' or False"


def check_lora_options(config: Any, quantization_mode: str | None) -> None:
    """Refuse an option the strategy would not run as peft means it, naming the fix."""
    for field, reasons in NOT_INJECTED.items():
        value = getattr(config, field, None)
        if value:
            why, fix = reasons
            raise ValueError(f"lora: {field}={value!r} {why} Fix: {fix}")
    check_lora_init(config, quantization_mode)


def check_lora_init(config: Any, quantization_mode: str | None) -> None:
    """Refuse an ``init_lora_weights`` the strategy would not run as peft means it, naming what is allowed."""
    init = config.init_lora_weights
    if not isinstance(init, str):
        return
    name = init.lower()
    if name in NOT_RUN:
        raise ValueError(
            f"lora: init_lora_weights={init!r} is not run by the strategy as peft means it: {NOT_RUN[name]}."
            f" Allowed: {ALLOWED} (with quantization: {ON_QUANTIZED}). Fix: one of those; 'pissa' (without"
            " quantization) and 'olora' also start from the weights' own directions."
        )
    if quantization_mode is not None and name.startswith(FLOAT_BASE):
        raise ValueError(
            f"lora: init_lora_weights={init!r} computes from each base weight in its dtype (PiSSA's and MiCA's SVD;"
            " orthogonal gives A and B that dtype), and"
            f" quantization={quantization_mode!r} has packed the weights into bitsandbytes' storage before LoRA is"
            " added: peft stops after the weights load, or with a traceback. Allowed"
            f" with quantization: {ON_QUANTIZED}. Fix: one of those, or quantization: null to run {init!r} on the"
            " weights in the compute dtype."
        )


def check_lora_init_on_rows(config: Any, world_size: int) -> None:
    """Under FSDP2 on several ranks each rank holds only its rows of every weight when LoRA is added; an init that
    decomposes the whole weight cannot run on them (a segmentation fault in sharding before this check)."""
    init = lora_init_among(config, FROM_WHOLE_WEIGHT)
    if world_size > 1 and init is not None:
        raise ValueError(
            f"lora: init_lora_weights={init!r} decomposes each whole base weight (PiSSA's and MiCA's SVD, OLoRA's"
            f" QR) when LoRA is added, and under lowprec_fsdp on {world_size} ranks each rank holds only its rows"
            " of every weight by then. Fix: strategy lowprec_ddp or one device, which hold whole weights, or"
            " init_lora_weights true (peft's default) or 'gaussian' under lowprec_fsdp."
        )
