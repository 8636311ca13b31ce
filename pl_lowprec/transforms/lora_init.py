"""The peft ``init_lora_weights`` the strategy runs as peft means them, checked when the strategy is built.

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
FLOAT_BASE = ("pissa", "mica", "orthogonal")  # pissa_niter_N too
ALLOWED = "True (peft's default), 'gaussian', 'pissa', 'pissa_niter_N', 'olora', 'orthogonal', 'mica' or False"
ON_QUANTIZED = "True (peft's default: A random, B zero), 'gaussian', 'olora' or False"


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
