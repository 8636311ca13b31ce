"""``estimate_memory``: will this configuration fit? The peak memory of a training step, predicted before the run.

The model is built on the meta device and transformed by the strategy's own ``ModelTransform``
(``simulated_transform.py``: bitsandbytes layers become their one stand-in, ``bnb_standin.py``); its tensors then
become fake CPU tensors (``FakeTensorMode``): shapes, dtypes and a device but no storage, so a model larger than
the machine costs nothing. One optimizer step then runs on them as Lightning runs it (``fake_step.py``), and
``StepTracker`` (``tracker.py``) follows every tensor storage from creation to free: the **peak** is the maximum
of live tensor bytes during the step (the whole accumulation window), and ``peak_phase`` says where it falls.
Checked against PyTorch's profiler allocation records (``benchmarks/peak_memory.py``, ``docs/memory.md``).

The components (weights by dtype, gradients, optimizer state: exact counts; activations: the bytes saved for
backward by the first forward) say what the memory is for; the peak is what must fit.

Assumed: unpadded, unpacked batches of the example batch's shape (``fake_model.eager_attention_masks``). Not
seen: scratch that kernels allocate outside tensor storages (oneDNN, cuBLAS workspaces), and, on CUDA, the
caching allocator's fragmentation: reserved memory is the predicted allocated peak plus that.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from pl_lowprec._checks import check_at_least
from pl_lowprec.distributed.sharding import Sharding
from pl_lowprec.loading.sources import shapes_only
from pl_lowprec.memory.bnb_standin import is_standin
from pl_lowprec.memory.collectives import Interconnect, count_ddp_all_reduce, ddp_buckets
from pl_lowprec.memory.compiled_backward import LABEL as COMPILED_LABEL
from pl_lowprec.memory.compiled_backward import compiled_backward_bytes
from pl_lowprec.memory.depth import extrapolated, repeated_blocks
from pl_lowprec.memory.devices import GPUS, device_spec, gpu_named
from pl_lowprec.memory.fake_distributed import fake_mesh
from pl_lowprec.memory.fake_step import DryRunTrainer, SimulatedStep, attached, simulate_step
from pl_lowprec.memory.op_counts import DTYPE_NAMES, OpProfile
from pl_lowprec.memory.simulated_optimizer import SimulatedOptimizer
from pl_lowprec.memory.simulated_transform import SimulatedTransform
from pl_lowprec.memory.step_time import StepTime, predict_step_time
from pl_lowprec.memory.tracker import allocated_bytes
from pl_lowprec.plugins.precision_choice import choose_precision
from pl_lowprec.transforms.config import TransformConfig
from pl_lowprec.transforms.dtypes import HALF_DTYPES, dtype_of_precision, unified_precision
from pl_lowprec.transforms.nf4 import local

DDP_BUCKETS = "ddp_buckets"  # the peak split's label for DDP's gradient buckets


PHASES = ("forward", "backward", "optimizer step")


@dataclass
class MemoryEstimate:
    """The predicted ``peak`` of live tensor bytes in one training step (the headline), where it falls, and the
    components; ``weights`` by dtype, quantized weights including their constants.

    ``timeline`` lists (point, bytes): after load (the step start: weights, optimizer state, the batch), the
    forward peak, the backward peak, the optimizer step's peak. ``peak_split`` divides the peak into weights,
    gradients, optimizer state, inputs, activations and temporaries; ``samples`` is that split after each op
    that allocated (for ``plot``).
    """

    weights: dict[str, int] = field(default_factory=dict)
    gradients: int = 0
    optimizer_state: int = 0
    activations: int = 0
    activations_offloaded_to_host: int = 0
    parameters: int = 0
    trainable_parameters: int = 0
    peak: int = 0
    peak_phase: str = ""
    timeline: list[tuple[str, int]] = field(default_factory=list)
    peak_split: dict[str, int] = field(default_factory=dict)
    host_peak: int = 0
    device: str = "cpu"
    world_size: int = 1
    seconds: float = 0.0
    samples: list[tuple[str, dict[str, int]]] = field(default_factory=list, repr=False)
    extrapolated: bool = False
    repeated_micro_batches: int = 0  # of the accumulation window, counted as the last simulated one (accumulation.py)
    ops: OpProfile = field(default_factory=OpProfile, repr=False)
    time_on: str | None = None
    interconnect: Interconnect | None = None  # the run's own, measured (``collectives.measure_interconnect``)
    optimizer: str = ""  # what the step simulated: "optimizer: AdamW (foreach), from configure_optimizers", ...

    @property
    def step_time(self) -> StepTime | None:
        """The predicted time of the step on ``time_on`` (``step_time.py``); ``None`` where there is no device to
        time it on (a CUDA run estimated on a machine without a GPU, and no ``time_on``)."""
        return None if self.time_on is None else self.step_time_on(self.time_on)

    def step_time_on(self, device: str) -> StepTime:
        """The predicted time of the same step on another device: ``"cpu"`` (this one) or a GPU of
        ``devices.GPUS`` (``"H100"``, ``"H200"``, ``"A100"``, ``"L4"``, ``"RTX4090"``, ``"T4"``). The collectives
        run on ``interconnect`` where the run measured it on this device, else on the device's own figures."""
        measured = self.interconnect if device == self.time_on else None
        return predict_step_time(self.ops, device_spec(device), measured)

    @property
    def total(self) -> int:
        """The sum of the components: not the peak (temporaries are missing, and not everything is held at
        once). Kept for comparison; plan with ``peak``."""
        return sum(self.weights.values()) + self.gradients + self.optimizer_state + self.activations

    def take_simulation(self, step: Any) -> None:
        """Peak, phase, timeline and split from a ``SimulatedStep``."""
        self.peak, self.peak_phase, self.peak_split = step.peak, step.peak_phase, dict(step.peak_split)
        self.timeline, self.samples, self.host_peak = list(step.timeline), list(step.samples), step.host_peak
        self.extrapolated, self.ops = step.extrapolated, step.ops
        self.repeated_micro_batches = step.repeated_micro_batches
        self.optimizer_state = step.optimizer_state

    def add_held_throughout(self, extra: int, label: str) -> None:
        """``extra`` bytes held through the whole step that the simulated step does not allocate (DDP's gradient
        buckets, made by its C++ reducer): every point of the timeline, the peak and each sample grow by them."""
        if extra <= 0:
            return
        self.timeline = [(point, value + extra) for point, value in self.timeline]
        self.peak += extra
        self.peak_split = self.peak_split | {label: extra}
        self.samples = [(phase, split | {label: extra}) for phase, split in self.samples]

    def add_to_backward_peak(self, extra: int, label: str) -> None:
        """``extra`` bytes held at the backward peak that the simulated step did not run (``compiled_backward.py``):
        the backward peak grows by them, and becomes the step's peak if it is then the highest."""
        at = next((i for i, (point, _) in enumerate(self.timeline) if point == "backward peak"), None)
        if at is None or extra <= 0:
            return
        backward = self.timeline[at][1] + extra
        self.timeline[at] = ("backward peak", backward)
        if self.peak_phase == "backward":
            self.peak, self.peak_split = backward, self.peak_split | {label: extra}
        elif backward > self.peak:
            self.peak, self.peak_phase = backward, "backward"
            self.peak_split = {label: extra, "the eager backward peak": backward - extra}

    def as_dict(self) -> dict[str, int]:
        flat = {f"params_{k}": v for k, v in self.weights.items()}
        flat |= {"gradients": self.gradients, "optimizer_state": self.optimizer_state}
        flat |= {"activations": self.activations}
        if self.activations_offloaded_to_host:
            flat["activations_offloaded_to_host"] = self.activations_offloaded_to_host
        return flat | {"total": self.total, "peak": self.peak}

    def table(self) -> str:
        where = f"per rank of {self.world_size}, " if self.world_size > 1 else ""
        lines = [
            f"Estimated training memory ({self.parameters:,} parameters, {self.trainable_parameters:,} trainable)",
            f"  PEAK {self.peak / 2**20:,.2f} MiB ({self.peak:,} bytes) during the {self.peak_phase}"
            f" ({where}{self.device}; estimated in {self.seconds:.1f} s): this is the figure that must fit.",
        ]
        if self.extrapolated:
            lines.append("  (blocks identical: simulated with 2 and 3 of them, extrapolated to the real depth)")
        if self.repeated_micro_batches:
            lines.append(
                f"  (the last {self.repeated_micro_batches} micro-batches of the window counted as the one before:"
                " two in a row ran alike)"
            )
        if self.optimizer:
            lines.append(f"  ({self.optimizer})")
        if self.device == "cuda":
            lines.append("  CUDA allocations rounded to 512 B; reserved memory adds the allocator's fragmentation.")
        if self.host_peak:
            lines.append(f"  host memory peak (offloaded activations): {self.host_peak / 2**20:,.2f} MiB")
        lines.append("  Over the step:")
        lines += [f"    {name:<24}{value / 2**20:>12.2f} MiB" for name, value in self.timeline]
        lines.append("  At the peak:")
        largest_first = sorted(self.peak_split.items(), key=lambda item: (-item[1], item[0]))
        lines += [f"    {k:<24}{v / 2**20:>12.2f} MiB" for k, v in largest_first if v]
        lines.append("  Components (what the memory is for; their total is not the peak):")
        lines.append(f"    {'component':<26}{'MiB':>12}{'bytes':>16}")
        lines += [f"    {k:<26}{v / 2**20:>12.2f}{v:>16d}" for k, v in self.as_dict().items() if k != "peak"]
        return "\n".join(lines)


@shapes_only()  # a pretrained= directory with only config.json: its shapes are all an estimate needs
def estimate_memory(
    build_model: Callable[[], nn.Module],
    example_batch: Any,
    precision: str = "32-true",
    device: str | torch.device | None = None,
    config: TransformConfig | None = None,
    accumulate_grad_batches: int = 1,
    extrapolate: bool = True,
    sharding: Sharding | None = None,
    world_size: int = 1,
    time_on: str | None = None,
    gradient_as_bucket_view: bool = False,
    **transform_args: Any,
) -> MemoryEstimate:
    """Predict the peak memory of a training step without allocating the model.

    Args:
        build_model: Builds the ``LightningModule`` (or ``nn.Module`` returning a loss); called on the meta
            device, so it allocates nothing. Its ``configure_model`` runs too, as the Trainer runs it.
        example_batch: One training batch (real or fake tensors of the real shapes).
        precision: The Trainer's precision string (``"bf16-mixed"``, ``"16-mixed"``, ``"bf16-true"``, ...), or
            ``"auto"`` for what ``AMPPrecision("auto")`` would choose on ``device``.
        device: The device the run will use, for ``precision="auto"`` and the CUDA allocator's rounding;
            ``None`` means CUDA if this machine has it, else the CPU.
        config: The strategy's model arguments as one ``TransformConfig`` (``strategy.transform_config``).
        accumulate_grad_batches: Micro-batches per optimizer step: the peak is that of the whole window.
        extrapolate: With a stack of 5 or more identical blocks, simulate 2, 3 and 4 of them and extrapolate
            every figure linearly to the real depth when the three lie on a line (else simulate every block):
            seconds for 8B shapes (``depth.py``). ``False`` always simulates every block.
        sharding: FSDP2 (``strategy.transform_sharding(config)``): the estimate is per rank of ``world_size``,
            simulated as rank 0 on a fake process group.
        world_size: The number of ranks the run shards over (with ``sharding``), or, without it, the DDP ranks
            whose gradient all-reduce the step time counts (the memory is one process's).
        time_on: The device ``estimate.step_time`` predicts the step's duration on: ``"cpu"`` (this machine,
            measured once) or a GPU of ``devices.GPUS`` (``"H100"``, ``"H200"``, ``"A100"``, ``"L4"``,
            ``"RTX4090"``, ``"T4"``). ``None``: ``device``, this machine's GPU where it has one; a CUDA run
            estimated without a GPU then has no step time (``estimate.step_time_on("H100")`` gives one).
        gradient_as_bucket_view: DDP's own argument (``world_size`` > 1 without ``sharding``;
            ``gradient_as_bucket_view(strategy)`` reads it): the gradients are views into DDP's buckets, so the
            buckets are held throughout and the gradients add nothing on top.
        **transform_args: Or the strategies' model arguments themselves (``quantization="nf4-dq"``,
            ``lora={"r": 16}``, ``activation_checkpointing=[...]``, ...: see ``TransformArguments``);
            ``optimizer="adamw"`` names the module's own torch AdamW, as no ``optimizer`` does.
    """
    config = _transform_config(config, transform_args)
    check_at_least("estimate_memory", 1, accumulate_grad_batches=accumulate_grad_batches)
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    precision = resolved_precision(precision, device, time_on)
    started = time.perf_counter()
    check_at_least("estimate_memory", 1, world_size=world_size)
    time_on = timed_device(time_on, device, precision)
    if sharding is None:
        in_buckets = gradient_as_bucket_view and world_size > 1
        args = (build_model, example_batch, precision, device, config, accumulate_grad_batches, extrapolate)
        estimate = _estimate(*args, None, in_buckets)
        estimate.time_on, estimate.ops.ranks = time_on, world_size
        if world_size > 1:  # DDP: its reducer's buckets and all-reduce, unseen by the simulated step
            estimate.world_size = world_size
            count_ddp_all_reduce(estimate.ops.collectives, estimate.gradients)
            buckets = sum(allocated_bytes(nbytes, device.type) for nbytes in ddp_buckets(estimate.gradients))
            estimate.add_held_throughout(buckets, DDP_BUCKETS)
        return estimate
    with fake_mesh(world_size) as mesh:
        estimate = _estimate(
            build_model,
            example_batch,
            precision,
            device,
            config,
            accumulate_grad_batches,
            False,
            dataclasses.replace(sharding, mesh=mesh),
        )
    estimate.world_size, estimate.time_on, estimate.ops.ranks = world_size, time_on, world_size
    estimate.seconds = time.perf_counter() - started
    return estimate


def resolved_precision(precision: str | int, device: str | torch.device, gpu: str | None = None) -> str:
    """``precision`` as Lightning runs it (``unified_precision``: ``"bf16"`` is ``"bf16-mixed"``, ``16`` is
    ``"16-mixed"``; a value Lightning refuses is refused), with ``"auto"`` as ``AMPPrecision("auto")`` chooses it:
    on the GPU named by ``gpu`` (bf16 where it computes bf16, else fp16 with loss scaling, as on a T4), else on
    ``device`` here. ``"auto"`` for CUDA, with no GPU named on a machine without one, is refused in one paragraph
    that names the fix (``--gpu NAME``, ``time_on="NAME"``)."""
    precision = unified_precision(precision)
    if precision != "auto":
        return precision
    if gpu is not None and gpu.lower() != "cpu":
        return "bf16-mixed" if "bf16" in device_spec(gpu).flops else "16-mixed"
    if torch.device(device).type == "cuda" and not torch.cuda.is_available():
        raise ValueError(
            "precision='auto' on CUDA is chosen for the GPU (bf16-mixed where it computes bf16, else 16-mixed with"
            " loss scaling), and this machine has no GPU to ask. Name the GPU the run is for: --gpu NAME (estimate,"
            f" plan) or time_on='NAME' (estimate_memory), NAME one of {', '.join(GPUS)}; or set the precision"
            " ('bf16-mixed' or '16-mixed')."
        )
    return choose_precision(device).precision


def timed_device(time_on: str | None, device: torch.device, precision: str) -> str | None:
    """The device to time the step on: ``time_on``, checked before the simulation (an unknown GPU, or a precision
    it does not compute, such as bf16 on a T4, is refused); else ``device``: this CPU, or this machine's GPU
    where the table knows it and its dtype (``None`` otherwise: no step time)."""
    dtype = DTYPE_NAMES.get(dtype_of_precision(precision), "fp32")
    if time_on is None:
        if device.type == "cpu":
            return "cpu"
        if device.type != "cuda" or not torch.cuda.is_available():
            return None
        here = gpu_named(torch.cuda.get_device_name(device))
        return here if here is not None and dtype in device_spec(here).flops else None
    if time_on.lower() == "cpu":
        return "cpu"
    device_spec(time_on).flops_per_second(dtype)
    return time_on


def _estimate(
    build_model: Callable[[], nn.Module],
    example_batch: Any,
    precision: str,
    device: torch.device,
    config: TransformConfig,
    accumulate_grad_batches: int,
    extrapolate: bool,
    sharding: Sharding | None = None,
    gradients_in_buckets: bool = False,
) -> MemoryEstimate:
    started = time.perf_counter()
    fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
    transform = SimulatedTransform(config, sharding, fake_mode)
    trainer = DryRunTrainer(transform, accumulate_grad_batches)
    compute_dtype = dtype_of_precision(precision)
    half_true = precision.endswith("-true") and compute_dtype in HALF_DTYPES
    with torch.device("meta"):  # structure, dtypes and shapes only: nothing is allocated
        model = build_model()
        with attached(model, trainer):
            if hasattr(model, "configure_model"):
                model.configure_model()
        if half_true:
            model.to(compute_dtype)  # the Trainer builds the module under the precision's default dtype
        transform.apply(model, _Precision(precision), device)
        if half_true:
            cast_unquantized(model, compute_dtype)  # Lightning's HalfPrecision.convert_module
    estimate = MemoryEstimate(device=device.type)
    trainable = _count_parameters(model, estimate)
    estimate.gradients = sum(_nbytes(local(p)) for p in trainable)  # per rank under FSDP
    autocast_dtype = compute_dtype if precision.endswith("-mixed") else None
    make_optimizer = SimulatedOptimizer(config.optimizer, device)

    def simulate() -> SimulatedStep:
        return simulate_step(
            model,
            example_batch,
            trainer,
            make_optimizer,
            autocast_dtype,
            config.activation_offloading,
            device.type,
            fake_mode,
            sharding is not None,
            gradients_in_buckets,
        )

    blocks = repeated_blocks(model) if extrapolate else None
    step = simulate() if blocks is None else extrapolated(simulate, blocks)
    estimate.activations, estimate.activations_offloaded_to_host = step.saved_bytes, step.offloaded_bytes
    estimate.take_simulation(step)
    estimate.optimizer = make_optimizer.said
    if config.compile_kwargs is not None:
        estimate.ops.compiled = True
        extra = compiled_backward_bytes(model, example_batch, autocast_dtype or compute_dtype)
        estimate.add_to_backward_peak(extra, COMPILED_LABEL)
    estimate.seconds = time.perf_counter() - started
    return estimate


class _Precision:
    """What ``ModelTransform.apply`` reads from a precision plugin."""

    def __init__(self, precision: str) -> None:
        self.precision = precision


def cast_unquantized(model: nn.Module, dtype: torch.dtype) -> None:
    """Floating parameters and buffers to ``dtype``, as ``HalfPrecision.convert_module`` does; quantized layers
    keep their storage and constants, as bitsandbytes' own layers do on ``.to(dtype)``."""
    for module in model.modules():
        if is_standin(module):
            if module.bias is not None:
                module.bias.data = module.bias.data.to(dtype)
            continue
        for table in (module._parameters, module._buffers):
            for name, tensor in table.items():
                if tensor is not None and tensor.is_floating_point() and tensor.dtype != dtype:
                    if isinstance(tensor, nn.Parameter):
                        tensor.data = tensor.data.to(dtype)
                    else:
                        table[name] = tensor.to(dtype)


def _count_parameters(model: nn.Module, estimate: MemoryEstimate) -> list[nn.Parameter]:
    """Fill ``weights`` (by dtype; quantized layers with their constants, shared code books once),
    ``parameters`` and ``trainable_parameters``; return the trainable parameters."""
    seen: set[int] = set()
    weights: dict[str, int] = {}
    parameters = 0
    trainable: list[nn.Parameter] = []
    for module in model.modules():
        if is_standin(module):
            key = "quantized_8bit" if module.weight.dtype == torch.int8 else "quantized_4bit"
            for tensor in [module.weight, *module.buffers(recurse=False)]:
                if id(tensor) not in seen:
                    seen.add(id(tensor))
                    weights[key] = weights.get(key, 0) + tensor.numel() * tensor.element_size()
            parameters += module.in_features * module.out_features
            seen.add(id(module.weight))
        for param in module.parameters(recurse=False):
            if id(param) in seen:
                continue
            seen.add(id(param))
            parameters += param.numel()
            held = local(param)  # under FSDP this rank's shard
            if is_traceable_wrapper_subclass(held):  # torchao NF4: the packed weight and its constants
                names, _ = held.__tensor_flatten__()
                inner = [getattr(held, name) for name in names]
                weights["quantized_4bit"] = weights.get("quantized_4bit", 0) + sum(_nbytes(t) for t in inner)
                continue
            key = str(param.dtype).removeprefix("torch.")
            weights[key] = weights.get(key, 0) + _nbytes(held)
            if param.requires_grad:
                trainable.append(param)
    estimate.weights, estimate.parameters = weights, parameters
    estimate.trainable_parameters = sum(p.numel() for p in trainable)
    return trainable


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


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
