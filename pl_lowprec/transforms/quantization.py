"""bitsandbytes base weights: ``nn.Linear`` layers become ``Linear4bit`` (nf4/fp4, optionally double-quantized) or
``Linear8bitLt`` (frozen int8), on CPU or CUDA.

``QuantizationConfig.from_mode("nf4-dq")`` takes Lightning's mode names. Which layers are replaced is the shared
linear-layer filter's choice (``pl_lowprec.transforms.linear_filter``: exact ``nn.Linear`` outside
``skip_modules``), and a layer that is already quantized is never quantized twice.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

import torch
from torch import nn

from pl_lowprec._imports import import_bitsandbytes
from pl_lowprec.transforms.dtypes import HALF_DTYPES, to_dtype
from pl_lowprec.transforms.linear_filter import DEFAULT_SKIP, is_target_linear, linear_names, swap_linear_layers

QuantMode = Literal["nf4", "nf4-dq", "fp4", "fp4-dq", "int8"]
QUANT_MODES: tuple[str, ...] = get_args(QuantMode)
LLM_INT8_THRESHOLD = 6.0  # transformers' llm_int8_threshold and Lightning's int8 layers; bitsandbytes' default is 0.0


@dataclass(frozen=True)
class QuantizationConfig:
    """How to quantize the base weights.

    Args:
        mode: ``"nf4"``, ``"nf4-dq"``, ``"fp4"``, ``"fp4-dq"`` (4-bit; ``-dq`` also quantizes the absmax
            constants) or ``"int8"`` (LLM.int8 with frozen int8 weights).
        compute_dtype: dtype of the 4-bit matmul; ``None`` takes the precision plugin's compute dtype.
        skip_modules: Glob patterns of module names to leave unquantized (default: output heads).
        quant_storage: Storage dtype of packed 4-bit weights (``uint8``; ``bfloat16`` for FSDP sharding).
        int8_threshold: ``"int8"`` only: LLM.int8's outlier threshold. Input features with a value above it
            are multiplied in 16-bit, the rest in int8: 6.0, as transformers' ``BitsAndBytesConfig``
            (``llm_int8_threshold``) and Lightning's ``"int8-training"`` run it. ``0.0`` quantizes every feature
            (bitsandbytes' own default: less memory, and more error where activations have outliers).
    """

    mode: QuantMode
    compute_dtype: torch.dtype | str | None = None
    skip_modules: Sequence[str] = field(default=DEFAULT_SKIP)
    quant_storage: torch.dtype | str = torch.uint8
    int8_threshold: float = LLM_INT8_THRESHOLD

    def __post_init__(self) -> None:
        if self.mode not in QUANT_MODES:
            raise ValueError(
                f"quantization mode {self.mode!r} is not supported. Allowed: {', '.join(map(repr, QUANT_MODES))}"
                " ('-dq' adds double quantization of the scaling constants)."
            )
        object.__setattr__(self, "compute_dtype", to_dtype(self.compute_dtype))
        object.__setattr__(self, "quant_storage", to_dtype(self.quant_storage))
        object.__setattr__(self, "skip_modules", tuple(self.skip_modules))
        threshold = self.int8_threshold
        if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or not threshold >= 0:
            raise ValueError(
                f"QuantizationConfig(int8_threshold={threshold!r}) is not valid: LLM.int8's outlier threshold is a"
                f" number >= 0 ({LLM_INT8_THRESHOLD}, transformers' default; 0.0 quantizes every input feature)."
            )

    @classmethod
    def from_mode(cls, mode: str, **overrides: Any) -> QuantizationConfig:
        return cls(mode=mode, **overrides)  # type: ignore[arg-type]

    @property
    def is_4bit(self) -> bool:
        return self.mode != "int8"

    def wants(self, module: nn.Module, name: str) -> bool:
        """Whether this layer is quantized: an exact ``nn.Linear`` not named in ``skip_modules``."""
        return is_target_linear(module, name, self.skip_modules)


def is_quantized(module: nn.Module) -> bool:
    return type(module).__name__ in ("Linear4bit", "Linear8bitLt") and isinstance(module, nn.Linear)


def quantize_model(
    model: nn.Module,
    config: QuantizationConfig,
    compute_dtype: torch.dtype,
    device: torch.device,
    quantize_layer: Callable[[nn.Linear, QuantizationConfig, torch.dtype, torch.device], nn.Module] | None = None,
) -> list[str]:
    """Quantize the model's exact ``nn.Linear`` layers on ``device`` (idempotent); return the names replaced.

    ``quantize_layer`` makes each layer (``quantize_linear``'s signature): bitsandbytes' by default, the memory
    estimate's stand-ins (``pl_lowprec.memory.bnb_standin``) in a fake step.
    Raises ``ValueError`` when nothing can be quantized and the model holds no quantized layer yet.
    """
    compute_dtype = config.compute_dtype or compute_dtype
    if quantize_layer is None:
        quantize_layer = quantize_linear
        if not config.is_4bit:
            check_int8_trains(import_bitsandbytes(), device)

    def make_layer(linear: nn.Linear, name: str) -> nn.Module:
        return quantize_layer(linear, config, compute_dtype, device)

    if any(is_quantized(m) for m in model.modules()):
        return []  # quantized before (a second fit, or validate then fit): LoRA's own Linears must stay as they are
    replaced = swap_linear_layers(model, make_layer, config.wants)
    share_code_books(model)
    if not replaced:
        linears = linear_names(model)
        raise ValueError(
            f"quantization={config.mode!r} found no nn.Linear to quantize in {type(model).__name__}"
            + (
                f": every linear layer matches skip_modules={list(config.skip_modules)} ({', '.join(linears)})."
                if linears
                else " (it has no linear layers). Quantization applies to nn.Linear weights only."
            )
        )
    return replaced


def will_quantize(module: nn.Module, name: str, config: QuantizationConfig) -> bool:
    """Whether ``quantize_model`` replaces this module: an exact ``nn.Linear`` not named in ``skip_modules``."""
    return config.wants(module, name)


def quantize_linear(
    linear: nn.Linear, config: QuantizationConfig, compute_dtype: torch.dtype, device: torch.device
) -> nn.Module:
    """The bitsandbytes layer for one ``nn.Linear`` with real weights, quantized on ``device``."""
    return _quantized_copy(import_bitsandbytes(), linear, config, config.compute_dtype or compute_dtype, device)


def dequantized_dtype(weight_dtype: torch.dtype, compute_dtype: torch.dtype) -> torch.dtype:
    """The dtype a 4-bit weight is quantized from, which is the dtype bitsandbytes dequantizes it to in every
    matmul (``QuantState.dtype``): the compute dtype when it is half precision. An fp32 weight would cost an fp32
    copy of the whole matrix, twice the bytes, before the cast to the compute dtype (224 against 112 MiB for one
    Llama-3.1-8B MLP projection). Quantizing a bf16 checkpoint's weights from bf16 or from their fp32 upcast gives
    the same packed weight and constants."""
    if weight_dtype == torch.float32 and compute_dtype in HALF_DTYPES:
        return compute_dtype
    return weight_dtype


def _quantized_copy(
    bnb: Any, linear: nn.Linear, config: QuantizationConfig, compute_dtype: torch.dtype, device: torch.device
) -> nn.Module:
    weight = linear.weight.data
    has_bias = linear.bias is not None
    if config.is_4bit:
        weight = weight.to(dequantized_dtype(weight.dtype, compute_dtype))
        quant_type, _, dq = config.mode.partition("-")
        layer = bnb.nn.Linear4bit(
            linear.in_features,
            linear.out_features,
            bias=has_bias,
            compute_dtype=compute_dtype,
            compress_statistics=bool(dq),
            quant_type=quant_type,
            quant_storage=config.quant_storage,
            device="meta",
        )
        layer.weight = bnb.nn.Params4bit(
            weight,
            requires_grad=False,
            compress_statistics=bool(dq),
            quant_type=quant_type,
            quant_storage=config.quant_storage,
            module=layer,
        )
        # On CPUs with avx512_bf16, an eval forward repacks the weight for inference, after which training
        # computes wrong LoRA gradients. Lightning's sanity check is such a forward: keep the training layout.
        layer.support_avx512bf16_for_cpu = False
    else:
        layer = bnb.nn.Linear8bitLt(
            linear.in_features,
            linear.out_features,
            bias=has_bias,
            has_fp16_weights=False,
            threshold=float(config.int8_threshold),
            device="meta",
        )
        layer.weight = bnb.nn.Int8Params(weight, requires_grad=False, has_fp16_weights=False)
    if has_bias:
        layer.bias = nn.Parameter(linear.bias.data, requires_grad=False)
    return layer.to(device)  # bitsandbytes quantizes on the move to a device


def share_code_books(model: nn.Module) -> None:
    """Point equal 4-bit code books (the NF4/FP4 table, the nested dynamic map) at one tensor.

    bitsandbytes gives every layer its own copy of these constant tables: 1.1 KB per layer with double
    quantization, 0.27 bytes per parameter on a 64x64 layer. They are only read, so one copy serves all.
    """
    shared: dict[tuple, torch.Tensor] = {}

    def one(code: torch.Tensor) -> torch.Tensor:
        key = (code.device, code.dtype, tuple(code.shape), code.cpu().numpy().tobytes())
        return shared.setdefault(key, code)

    for module in model.modules():
        state = getattr(getattr(module, "weight", None), "quant_state", None)
        if state is None:
            continue
        state.code = one(state.code)
        if getattr(state, "state2", None) is not None:
            state.state2.code = one(state.state2.code)


_INT8_OK: dict[str, bool] = {}


def check_int8_trains(bnb: Any, device: torch.device) -> None:
    """Run one tiny int8 forward and backward on ``device``; raise a clear error if bitsandbytes cannot.

    It runs on a fork of the random state: its draws (the layer's init, its test tensors) shifted every random init
    that follows (LoRA's A) in the first fit of a process only, so the same seed gave other adapters than peft's
    and than a second fit in the same process."""
    if _INT8_OK.get(str(device)):
        return
    try:
        index = device.index if device.index is not None else torch.get_device_module(device.type).current_device()
        with torch.random.fork_rng(devices=[] if device.type == "cpu" else [index], device_type=device.type):
            _int8_forward_backward(bnb, device)
    except Exception as err:  # any failure of the backend means the mode cannot train here
        raise ValueError(
            f"quantization='int8' cannot train on {device}: bitsandbytes failed a test forward and backward"
            f" ({type(err).__name__}: {err}). Modes that can run here: 'nf4', 'nf4-dq', 'fp4', 'fp4-dq'."
        ) from err
    _INT8_OK[str(device)] = True


def _int8_forward_backward(bnb: Any, device: torch.device) -> None:
    """Both of LLM.int8's paths: an input feature above the outlier threshold, the rest in int8."""
    layer = bnb.nn.Linear8bitLt(64, 64, bias=False, has_fp16_weights=False, threshold=LLM_INT8_THRESHOLD)
    layer.weight = bnb.nn.Int8Params(torch.randn(64, 64), requires_grad=False, has_fp16_weights=False)
    layer = layer.to(device)
    x = torch.randn(4, 64, device=device)
    x[:, 0] = 2 * LLM_INT8_THRESHOLD
    layer(x.requires_grad_(True)).float().sum().backward()
