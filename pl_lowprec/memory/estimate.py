"""``estimate_memory``: will this configuration fit? A prediction of training memory before the run.

The model is built on the meta device, then its tensors become fake CPU tensors (``FakeTensorMode``): shapes,
dtypes and a device but no storage, so a model larger than the machine costs nothing. On that model:

- weights, quantization constants, gradients and optimizer state are counted from the parameters with the
  same formulas bitsandbytes and torch allocate by (exact for the example models);
- activations are the bytes saved for backward by one fake training step, run under the precision's
  autocast with LoRA injected and activation checkpointing applied, counted as ``MemoryTracker`` counts them;
  with activation offloading the step runs under the same offloading hooks, and the bytes they move are
  reported apart (``activations_offloaded_to_host``: host memory, not part of the device ``total``);
- with ``qat=`` and ``fp8=`` the same torchao layers run in the fake step (fp8 emulated: torchao's float8
  layers save their high-precision inputs and re-cast in backward, so the saved bytes are the real ones; the
  float8 copies made inside each matmul are transient and not counted).

Quantized layers stay plain ``nn.Linear`` in the fake model (bitsandbytes kernels do not run on fake
tensors); their frozen weights are put in the compute dtype so that autocast makes no extra copy of them,
as the 4-bit matmul makes none that autograd keeps.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from collections.abc import Callable, Mapping
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from pl_lowprec.memory.activations import count_saved_tensors
from pl_lowprec.plugins.precision_choice import choose_precision
from pl_lowprec.transforms.checkpointing import set_activation_checkpointing
from pl_lowprec.transforms.config import TransformConfig
from pl_lowprec.transforms.dtypes import dtype_of_precision
from pl_lowprec.transforms.fp8 import convert_to_fp8
from pl_lowprec.transforms.linear_filter import swap_linear_layers
from pl_lowprec.transforms.lora import inject_lora, prepare_for_kbit_training
from pl_lowprec.transforms.offloading import OffloadActivations
from pl_lowprec.transforms.qat import prepare_qat
from pl_lowprec.transforms.quantization import QuantizationConfig

MIN_8BIT_SIZE = 4096  # bitsandbytes keeps 32-bit optimizer state below this many elements
OPTIMIZER_BLOCK = 256  # bitsandbytes' blockwise 8-bit optimizer state: one fp32 absmax per block
NF4_BLOCK, NESTED_BLOCK = 64, 256


@dataclass
class MemoryEstimate:
    """Predicted bytes per component; ``weights`` by dtype, quantized weights including their constants."""

    weights: dict[str, int] = field(default_factory=dict)
    gradients: int = 0
    optimizer_state: int = 0
    activations: int = 0
    activations_offloaded_to_host: int = 0
    parameters: int = 0
    trainable_parameters: int = 0

    @property
    def total(self) -> int:
        return sum(self.weights.values()) + self.gradients + self.optimizer_state + self.activations

    def as_dict(self) -> dict[str, int]:
        flat = {f"params_{k}": v for k, v in self.weights.items()}
        flat |= {"gradients": self.gradients, "optimizer_state": self.optimizer_state}
        flat |= {"activations": self.activations}
        if self.activations_offloaded_to_host:
            flat["activations_offloaded_to_host"] = self.activations_offloaded_to_host
        return flat | {"total": self.total}

    def table(self) -> str:
        lines = [
            f"Estimated training memory ({self.parameters:,} parameters, {self.trainable_parameters:,} trainable)",
            f"  {'component':<26}{'MiB':>12}{'bytes':>16}",
        ]
        lines += [f"  {k:<26}{v / 2**20:>12.2f}{v:>16d}" for k, v in self.as_dict().items()]
        return "\n".join(lines)


def quantized_linear_bytes(out_features: int, in_features: int, mode: str) -> int:
    """Bytes of one bitsandbytes layer's weight and its constants (code books excluded: shared, see below)."""
    numel = out_features * in_features
    if mode == "int8":
        return numel + out_features * 4  # int8 weight + one fp32 scale per row
    blocks = math.ceil(numel / NF4_BLOCK)
    packed = math.ceil(numel / 2)
    if mode.endswith("-dq"):
        return packed + blocks + math.ceil(blocks / NESTED_BLOCK) * 4 + 4  # uint8 absmax, nested fp32, offset
    return packed + blocks * 4


def code_book_bytes(mode: str) -> int:
    """The 4-bit code book and, with double quantization, the nested map: one copy per model."""
    return 0 if mode == "int8" else 16 * 4 + (256 * 4 if mode.endswith("-dq") else 0)


def optimizer_state_bytes(trainable: list[nn.Parameter], optimizer: str) -> int:
    """AdamW: two moments in the parameter dtype and a fp32 step per tensor. bitsandbytes: 8-bit blockwise state
    for tensors of 4096+ elements (uint8 plus a fp32 absmax per 256), 32-bit below that. torchao's AdamW8bit: the
    same blocks, with its own 256-entry fp32 map per state tensor, state in the parameter dtype below that, and a
    fp32 step."""
    states = 1 if optimizer == "lion8bit" else 2
    total = 0
    eight_bit = optimizer in ("adamw8bit", "paged_adamw8bit", "lion8bit")
    for param in trainable:
        n = param.numel()
        if optimizer in (None, "adamw"):
            total += 2 * n * param.element_size() + 4
        elif optimizer == "torchao_adamw8bit":
            quantized = n >= MIN_8BIT_SIZE and n % OPTIMIZER_BLOCK == 0
            per_state = n + n // OPTIMIZER_BLOCK * 4 + 256 * 4 if quantized else n * param.element_size()
            total += states * per_state + 4  # and a fp32 step
        elif eight_bit and n >= MIN_8BIT_SIZE:
            total += states * (n + math.ceil(n / OPTIMIZER_BLOCK) * 4)
        else:
            total += states * n * 4
    if eight_bit and any(p.numel() >= MIN_8BIT_SIZE for p in trainable):
        total += states * 256 * 4  # the shared dynamic quantization maps
    return total


def estimate_memory(
    build_model: Callable[[], nn.Module],
    example_batch: Any,
    precision: str = "32-true",
    device: str | torch.device | None = None,
    config: TransformConfig | None = None,
    **transform_args: Any,
) -> MemoryEstimate:
    """Predict the training memory of a configuration without allocating the model.

    Args:
        build_model: Builds the ``LightningModule`` (or ``nn.Module`` returning a loss); called on the meta
            device, so it allocates nothing.
        example_batch: One training batch (real or fake tensors of the real shapes).
        precision: The Trainer's precision string (``"bf16-mixed"``, ``"16-mixed"``, ``"bf16-true"``, ...), or
            ``"auto"`` for what ``AMPPrecision("auto")`` would choose on ``device``.
        device: The device the run will use, for ``precision="auto"``; ``None`` means CUDA if this machine has
            it, else the CPU.
        config: The strategy's model arguments as one ``TransformConfig`` (``strategy.transform_config``).
        **transform_args: Or the strategies' model arguments themselves (``quantization="nf4-dq"``,
            ``lora={"r": 16}``, ``activation_checkpointing=[...]``, ...: see ``TransformArguments``);
            ``optimizer="adamw"`` names the module's own torch AdamW, as no ``optimizer`` does.
    """
    config = _transform_config(config, transform_args)
    quantization, lora = config.quantization, config.lora
    if precision == "auto":
        precision = choose_precision(device or ("cuda" if torch.cuda.is_available() else "cpu")).precision
    compute_dtype = dtype_of_precision(precision)
    mixed = precision.endswith("-mixed")
    with torch.device("meta"):  # structure, dtypes and shapes only: nothing is allocated
        model = build_model()
        if precision.endswith("-true") and precision != "32-true":
            model = model.to(compute_dtype)
        estimate = MemoryEstimate()
        estimate.weights, quantized = _weights_after_quantization(model, quantization, compute_dtype)
        if config.qat is not None:  # weights stay trainable in full precision; fake quantization saves its own
            prepare_qat(model, config.qat)
        if config.fp8 is not None:  # emulated, so it runs on fake CPU tensors; it saves what float8 layers save
            convert_to_fp8(model, dataclasses.replace(config.fp8, emulate=True))
        if lora is not None:
            inject_lora(model, lora, config.skip_modules)
            prepare_for_kbit_training(model, mixed_precision=mixed)
            if precision.endswith("-true") and precision != "32-true":
                model.to(compute_dtype)  # Lightning's HalfPrecision casts the adapters too
            for param in _lora_parameters(model):
                key = str(param.dtype).removeprefix("torch.")
                estimate.weights[key] = estimate.weights.get(key, 0) + param.numel() * param.element_size()
        trainable = [p for p in model.parameters() if p.requires_grad and id(p) not in quantized]
        estimate.parameters = sum(p.numel() for p in model.parameters())
        estimate.trainable_parameters = sum(p.numel() for p in trainable)
        estimate.gradients = sum(p.numel() * p.element_size() for p in trainable)
        estimate.optimizer_state = optimizer_state_bytes(trainable, config.optimizer)
        if config.activation_checkpointing is not None:
            set_activation_checkpointing(
                model,
                config.activation_checkpointing,
                config.checkpoint_every_n,
                config.checkpoint_impl,
                config.checkpoint_mode,
            )
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        _materialize_fake(model)
        estimate.activations, estimate.activations_offloaded_to_host = _saved_bytes(
            model, _to_fake(mode, example_batch), compute_dtype if mixed else None, config.activation_offloading
        )
    return estimate


def _transform_config(config: TransformConfig | None, transform_args: dict[str, Any]) -> TransformConfig:
    """One ``TransformConfig`` from ``config=`` or the model arguments given one by one (not both)."""
    if config is not None and transform_args:
        raise TypeError(
            f"estimate_memory got config= and the model arguments {', '.join(sorted(transform_args))}: pass"
            " one of them (config=strategy.transform_config, or the arguments one by one)."
        )
    if config is not None:
        return config
    if transform_args.get("optimizer") == "adamw":
        transform_args = {**transform_args, "optimizer": None}
    return TransformConfig(**transform_args)


class _QuantizedStandIn(nn.Linear):
    """Stands in for a bitsandbytes layer in the fake run: frozen weight in the compute dtype, input cast to it.
    ``Linear4bit`` casts its output back to the input dtype, ``Linear8bitLt`` does not; what follows the layer
    then saves tensors of that dtype."""

    output_in_input_dtype = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = nn.functional.linear(x.to(self.weight.dtype), self.weight, self.bias)
        return out.to(x.dtype) if self.output_in_input_dtype else out


def _weights_after_quantization(
    model: nn.Module, quantization: QuantizationConfig | None, compute_dtype: torch.dtype
) -> tuple[dict[str, int], set[int]]:
    """Weight bytes by dtype as they will be after quantization; the ids of the quantized weights.

    Quantized layers are replaced, through the package's one layer-swapping function, by stand-ins."""
    weights: dict[str, int] = {}
    quantized: set[int] = set()
    if quantization is not None:
        key = "quantized_8bit" if quantization.mode == "int8" else "quantized_4bit"

        def stand_in(linear: nn.Linear, name: str) -> nn.Module:
            weights[key] = weights.get(key, 0) + quantized_linear_bytes(*linear.weight.shape, quantization.mode)
            layer = _QuantizedStandIn(linear.in_features, linear.out_features, linear.bias is not None)
            layer.output_in_input_dtype = quantization.is_4bit
            layer.weight = nn.Parameter(linear.weight.to(quantization.compute_dtype or compute_dtype), False)
            if linear.bias is not None:
                layer.bias = nn.Parameter(linear.bias.detach(), False)
            quantized.add(id(layer.weight))
            return layer

        swap_linear_layers(model, stand_in, quantization.wants)
        if quantized:
            weights[key] += code_book_bytes(quantization.mode)
    seen: set[int] = set()
    for param in model.parameters():
        if id(param) in quantized or id(param) in seen:
            continue
        seen.add(id(param))
        dtype = str(param.dtype).removeprefix("torch.")
        weights[dtype] = weights.get(dtype, 0) + param.numel() * param.element_size()
    return weights, quantized


def _materialize_fake(model: nn.Module) -> None:
    """Replace meta tensors by fake CPU tensors (call inside ``FakeTensorMode``): no storage, but CPU autocast
    applies to them. Shared (tied) parameters stay shared."""
    made: dict[int, torch.Tensor] = {}
    for module in model.modules():
        for table in (module._parameters, module._buffers):
            for name, tensor in table.items():
                if tensor is None:
                    continue
                if id(tensor) not in made:
                    fake = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu")
                    made[id(tensor)] = nn.Parameter(fake, tensor.requires_grad) if table is module._parameters else fake
                table[name] = made[id(tensor)]


def _lora_parameters(model: nn.Module) -> list[nn.Parameter]:
    return [p for n, p in model.named_parameters() if "lora_" in n]


def _to_fake(mode: FakeTensorMode, batch: Any) -> Any:
    if isinstance(batch, torch.Tensor):
        return mode.from_tensor(batch)
    if isinstance(batch, Mapping):
        return {k: _to_fake(mode, v) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        return type(batch)(_to_fake(mode, v) for v in batch)
    return batch


def _saved_bytes(model: nn.Module, batch: Any, autocast_dtype: torch.dtype | None, offloading: bool) -> tuple[int, int]:
    """Bytes saved for backward by one training step: kept on the device, and moved to host by offloading."""
    model.train()
    offload = OffloadActivations(torch.device("cpu"), [*model.parameters(), *model.buffers()]) if offloading else None
    with warnings.catch_warnings():
        # a dry-run training_step logs without a Trainer; Lightning's warning about that is expected here
        warnings.filterwarnings("ignore", message=r".*self\.log.*")
        with (
            count_saved_tensors(model) as counter,
            torch.autocast("cpu", dtype=autocast_dtype or torch.float32, enabled=autocast_dtype is not None),
            offload or nullcontext(),
        ):
            output = model.training_step(batch, 0) if hasattr(model, "training_step") else model(batch)
    loss = output["loss"] if isinstance(output, Mapping) else output
    del loss
    return counter.nbytes, counter.offloaded_nbytes
