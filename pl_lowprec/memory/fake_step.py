"""One optimizer step on fake tensors, as Lightning's loop runs it, under a ``StepTracker``.

The loop is the one Lightning's automatic optimization runs, written out: for each micro-batch of the window
``training_step`` (under the precision's autocast) and ``backward``; then ``on_before_optimizer_step`` and the
optimizer step. Lightning frees the gradients (``zero_grad``, set to ``None``) inside the closure of the window's
first micro-batch, after its ``training_step`` and before its ``backward``, so the last step's gradients are held
through that forward: the step starts with them (``prime_optimizer`` leaves them), and they are freed there.
No Trainer is built: the module sees a ``DryRunTrainer`` that answers what training steps ask (accumulation,
world size, a reduce that returns its input), and ``self.log`` does nothing. Once two micro-batches in a row ran
alike, the rest of the window is counted, not run (``accumulation.py``).

Under manual optimization (``automatic_optimization = False``, the only way Lightning runs several optimizers) the
step is the module's own ``training_step``: ``self.optimizers()`` gives each optimizer (its ``step`` is the
optimizer step phase) and ``manual_backward`` the backward phase. Its state and gradients at the step start are
those the module's own step leaves: every optimizer primed, then one untracked ``training_step``.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from pl_lowprec.memory.accumulation import AfterMicroBatch, after_micro_batch, count_repeats, ran_alike
from pl_lowprec.memory.activations import count_saved_tensors
from pl_lowprec.memory.breakdown import optimizer_state_bytes
from pl_lowprec.memory.fake_model import eager_attention_masks, fake_tensors
from pl_lowprec.memory.op_counts import OpCounter, OpProfile
from pl_lowprec.memory.tracker import StepTracker
from pl_lowprec.transforms.offloading import OffloadActivations

if TYPE_CHECKING:  # simulated_optimizer imports this module
    from pl_lowprec.memory.simulated_optimizer import SimulatedOptimizer


@dataclass
class _DryRunStrategy:
    transform: Any
    world_size: int = 1
    tracker: StepTracker | None = None  # the manual step's phases are marked on it
    _lightning_optimizers: list[DryRunOptimizer] = field(default_factory=list)  # what self.optimizers() reads

    def reduce(self, tensor: Any, *args: Any, **kwargs: Any) -> Any:
        return tensor  # every rank sees the same batch shapes

    def backward(self, loss: torch.Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> None:
        """``manual_backward``: the backward phase."""
        with within_phase(self.tracker, "backward"):
            loss.backward(*args, **kwargs)


class DryRunOptimizer:
    """What ``self.optimizers()`` gives a manual ``training_step``, as Lightning's ``LightningOptimizer``: its
    ``step`` runs the closure, the module's ``on_before_optimizer_step`` and the step (the optimizer step phase);
    anything else is the optimizer's."""

    def __init__(self, optimizer: torch.optim.Optimizer, strategy: _DryRunStrategy, module: nn.Module) -> None:
        self._optimizer, self._strategy, self._module = optimizer, strategy, module

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        return self._optimizer

    def step(self, closure: Callable[[], Any] | None = None, **kwargs: Any) -> Any:
        if closure is not None:
            closure()
        with within_phase(self._strategy.tracker, "optimizer step"):
            if hasattr(self._module, "on_before_optimizer_step"):
                self._module.on_before_optimizer_step(self._optimizer)
            return self._optimizer.step(**kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._optimizer, name)


@contextmanager
def within_phase(tracker: StepTracker | None, name: str) -> Iterator[None]:
    """``tracker.phase(name)`` inside a manual ``training_step``, back to the phase before afterwards (nothing
    without a tracker: the untracked first step)."""
    if tracker is None:
        yield
        return
    before = tracker.phase_name
    with tracker.phase(name):
        yield
    tracker.phase_name = before


@dataclass
class DryRunTrainer:
    """What a ``LightningModule`` reads from its trainer during ``configure_model`` and a training step."""

    transform: Any
    accumulate_grad_batches: int = 1
    world_size: int = 1
    lightning_module: Any = None
    strategy: _DryRunStrategy = field(init=False)
    datamodule: Any = None
    estimated_stepping_batches: int = 1
    global_rank: int = 0
    local_rank: int = 0
    barebones: bool = True  # self.log() returns at once
    optimizers: list[torch.optim.Optimizer] = field(default_factory=list)  # toggle_optimizer reads them
    lr_scheduler_configs: list[Any] = field(default_factory=list)  # what self.lr_schedulers() reads

    def __post_init__(self) -> None:
        self.strategy = _DryRunStrategy(self.transform, self.world_size)


@contextmanager
def attached(model: nn.Module, trainer: DryRunTrainer) -> Iterator[None]:
    """``model.trainer`` is ``trainer`` inside (LightningModules only), and what it had before afterwards."""
    if not hasattr(model, "_trainer"):
        yield
        return
    before = model._trainer
    trainer.lightning_module = model
    model._trainer = trainer
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=r".*self\.log.*")
            yield
    finally:
        model._trainer = before


@contextmanager
def quiet_fake_data_pointers() -> Iterator[None]:
    """torchao's NF4 all-gather (FSDP2) asserts that its output shares storage with the buffer it gathered into,
    through ``data_ptr()``; fake tensors have no data, so torch warns at every gathered layer of the simulated
    step. The real step's gathers still check it."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Accessing the data pointer of FakeTensor", category=UserWarning)
        yield


def prime_optimizer(optimizer: torch.optim.Optimizer, trainable: list[nn.Parameter]) -> None:
    """The state after step 1, without running step 1: zero gradients for the ``trainable`` parameters, one step.
    The gradients stay, as the last step's do when the next one starts under Lightning."""
    for param in trainable:
        param.grad = torch.zeros_like(param)
    optimizer.step()


def run_step(
    model: nn.Module,
    batch: Any,
    optimizer: torch.optim.Optimizer,
    tracker: StepTracker,
    autocast_dtype: torch.dtype | None,
    accumulate_grad_batches: int = 1,
    step_context: AbstractContextManager | None = None,
    first_forward: AbstractContextManager | None = None,
) -> int:
    """One optimizer step: ``accumulate_grad_batches`` forwards and backwards, then the optimizer step.
    ``step_context`` wraps each ``training_step`` (activation offloading, as the strategy does);
    ``first_forward`` the first one only. Once two micro-batches in a row ran alike, the rest are counted, not run
    (``accumulation.py``): returns how many were. The last step's gradients are freed after the first
    ``training_step`` and kept after the optimizer step, where Lightning frees and keeps them."""
    model.train()
    records: list[AfterMicroBatch] = []
    for index in range(accumulate_grad_batches):
        if len(records) == 3 and ran_alike(*records):
            repeats = accumulate_grad_batches - index
            count_repeats(tracker, records[-2], records[-1], repeats)
            break
        with (
            tracker.phase("forward"),
            first_forward if index == 0 and first_forward is not None else nullcontext(),
            step_context or nullcontext(),  # innermost saved-tensor hooks win: offloading reports to the counter
            # as Lightning's MixedPrecision: no cache, so each weight's cast is freed when no longer needed
            torch.autocast(
                "cpu", dtype=autocast_dtype or torch.float32, enabled=autocast_dtype is not None, cache_enabled=False
            ),
        ):
            output = model.training_step(batch, index) if hasattr(model, "training_step") else model(batch)
        loss = output["loss"] if isinstance(output, Mapping) else output
        del output
        if index == 0:  # Lightning's closure: zero_grad after the window's first training_step, before backward
            optimizer.zero_grad(set_to_none=True)
        if loss.dim() > 0:  # a plain module's output, not a loss: reduced to one, as a loss function would
            loss = loss.sum()
        with tracker.phase("backward"):
            loss.backward()
        del loss
        if getattr(tracker, "counter", None) is not None and accumulate_grad_batches > 3:  # a real step runs all
            records = [*records[-2:], after_micro_batch(tracker)]
    else:
        repeats = 0
    with tracker.phase("optimizer step"):
        if hasattr(model, "on_before_optimizer_step"):
            model.on_before_optimizer_step(optimizer)
        optimizer.step()
    return repeats


def run_manual_step(
    model: nn.Module,
    batch: Any,
    tracker: StepTracker | None,
    autocast_dtype: torch.dtype | None,
    step_context: AbstractContextManager | None = None,
    first_forward: AbstractContextManager | None = None,
) -> None:
    """One step under manual optimization: the module's ``training_step``, which backs up and steps its optimizers
    itself (``DryRunOptimizer``, ``_DryRunStrategy.backward``); untracked without a ``tracker``."""
    model.train()
    with (
        within_phase(tracker, "forward"),
        first_forward or nullcontext(),
        step_context or nullcontext(),
        torch.autocast(
            "cpu", dtype=autocast_dtype or torch.float32, enabled=autocast_dtype is not None, cache_enabled=False
        ),
    ):
        model.training_step(batch, 0)


def manual_optimization(model: nn.Module) -> bool:
    return hasattr(model, "training_step") and not getattr(model, "automatic_optimization", True)


def prime_manual_step(
    model: nn.Module, batch: Any, trainer: DryRunTrainer, optimizers: list[torch.optim.Optimizer], autocast: Any
) -> None:
    """The state after step 1 of a manual ``training_step``: every optimizer primed over its own parameters, then
    one untracked step, which leaves the gradients where the module's own step leaves them."""
    if trainer.accumulate_grad_batches != 1:
        raise ValueError(
            f"accumulate_grad_batches={trainer.accumulate_grad_batches} with manual optimization"
            " (automatic_optimization = False), which Lightning refuses: the module's training_step accumulates"
            " itself. Estimate with accumulate_grad_batches=1."
        )
    for optimizer in optimizers:
        prime_optimizer(optimizer, [p for group in optimizer.param_groups for p in group["params"] if p.requires_grad])
    trainer.optimizers = optimizers
    trainer.strategy._lightning_optimizers = [DryRunOptimizer(o, trainer.strategy, model) for o in optimizers]
    run_manual_step(model, batch, None, autocast)


PHASES = ("forward", "backward", "optimizer step")


@dataclass
class SimulatedStep:
    """What one fake step measured: the peak, where, its split by category, the timeline (after load, then each
    phase's peak), one split per allocating op (``samples``), and the bytes saved for backward by the first
    forward (``saved_bytes``; ``offloaded_bytes`` of them moved to host memory by activation offloading)."""

    peak: int
    peak_phase: str
    peak_split: dict[str, int]
    timeline: list[tuple[str, int]]
    samples: list[tuple[str, dict[str, int]]]
    saved_bytes: int
    offloaded_bytes: int
    host_peak: int = 0
    optimizer_state: int = 0  # the bytes of the optimizer's state, each storage once (not rounded)
    extrapolated: bool = False  # from 2 and 3 identical blocks (depth.py)
    ops: OpProfile = field(default_factory=OpProfile)  # the kernels of the step, for its time (step_time.py)
    repeated_micro_batches: int = 0  # counted as the last simulated one, not run (accumulation.py)
    phase_splits: dict[str, dict[str, int]] = field(default_factory=dict)  # by timeline name: the split at its peak


def simulate_step(
    model: nn.Module,
    example_batch: Any,
    trainer: DryRunTrainer,
    make_optimizer: SimulatedOptimizer,
    autocast_dtype: torch.dtype | None,
    offloading: bool,
    device_type: str,
    mode: FakeTensorMode | None = None,
    sharded: bool = False,
    gradients_in_buckets: bool = False,
) -> SimulatedStep:
    """Make the meta-device ``model`` fake, prime the optimizer, run one tracked step; the model is left on the
    meta device again, so this can run repeatedly (with fewer blocks, ``depth.py``). A ``sharded`` (FSDP2)
    model is made fake by FSDP's own ``to_empty`` instead, for good: it runs once. ``gradients_in_buckets``:
    DDP's ``gradient_as_bucket_view=True`` (``StepTracker``), the buckets counted by the caller."""
    mode = mode or FakeTensorMode(allow_non_fake_inputs=True)
    with (
        eager_attention_masks(),
        mode,
        _sharded_to_empty(model) if sharded else fake_tensors(model),
        attached(model, trainer),
        quiet_fake_data_pointers(),
    ):
        batch = _to_fake(mode, example_batch)
        optimizers = make_optimizer(model)  # on the fake parameters, as configure_optimizers builds them
        manual = manual_optimization(model)
        if manual:
            trainer.lr_scheduler_configs = make_optimizer.schedulers
            prime_manual_step(model, batch, trainer, optimizers, autocast_dtype)
        else:
            prime_optimizer(optimizers[0], [p for p in model.parameters() if p.requires_grad])
        state_bytes = optimizer_state_bytes(optimizers)
        counter = OpCounter()
        tracker = StepTracker(model, optimizers, batch_tensors(batch), device_type, counter, gradients_in_buckets)
        offload = SimulatedOffload(tracker, [*model.parameters(), *model.buffers()]) if offloading else None
        saved: list[Any] = []

        @contextmanager
        def count_first_forward() -> Iterator[None]:
            with count_saved_tensors(model) as counter:
                saved.append(counter)
                yield

        with tracker:
            tracker.reset()
            if manual:
                trainer.strategy.tracker, repeated = tracker, 0
                run_manual_step(model, batch, tracker, autocast_dtype, offload, count_first_forward())
                trainer.strategy.tracker = None
            else:
                step_args = (autocast_dtype, trainer.accumulate_grad_batches, offload, count_first_forward())
                repeated = run_step(model, batch, optimizers[0], tracker, *step_args)
        tracker.remove_hooks()
    timeline = [tracker.timeline[0][:2]]
    phases = [name for name in PHASES if name in tracker.phase_peaks]
    timeline += [(f"{name} peak", tracker.phase_peaks[name][0]) for name in phases]
    return SimulatedStep(
        tracker.peak,
        tracker.peak_phase,
        dict(tracker.peak_split),
        timeline,
        list(tracker.samples),
        saved[0].nbytes,
        saved[0].offloaded_nbytes,
        tracker.host_peak,
        optimizer_state=state_bytes,
        ops=counter.profile,
        repeated_micro_batches=repeated,
        phase_splits={f"{name} peak": dict(tracker.phase_peaks[name][1]) for name in phases},
    )


class SimulatedOffload(OffloadActivations):
    """Activation offloading as it runs on CUDA, in the fake CPU step: each moved tensor's copy lives in host
    memory (``StepTracker.on_host``) and backward makes a device copy again, which lives as long as autograd
    needs it."""

    def __init__(self, tracker: StepTracker, exclude: list[torch.Tensor]) -> None:
        super().__init__(torch.device("cpu"), exclude)
        self.tracker = tracker

    def _to_host(self, tensor: torch.Tensor) -> torch.Tensor:
        with self.tracker.on_host():
            return super()._to_host(tensor)

    def _to_device(self, packed: Any) -> torch.Tensor:
        return packed.tensor.clone()


@contextmanager
def _sharded_to_empty(model: nn.Module) -> Iterator[None]:
    model.to_empty(device="cpu")  # FSDP2 re-creates each DTensor shard (and torchao NF4) as a fake tensor
    yield


def _to_fake(mode: FakeTensorMode, batch: Any) -> Any:
    if isinstance(batch, torch.Tensor):
        return mode.from_tensor(batch)
    if isinstance(batch, Mapping):
        return {k: _to_fake(mode, v) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        return type(batch)(_to_fake(mode, v) for v in batch)
    return batch


def batch_tensors(batch: Any) -> list[torch.Tensor]:
    """Every tensor of a batch (a tensor, or mappings and sequences of them), in order."""
    if isinstance(batch, torch.Tensor):
        return [batch]
    if isinstance(batch, Mapping):
        return [t for v in batch.values() for t in batch_tensors(v)]
    if isinstance(batch, (list, tuple)):
        return [t for v in batch for t in batch_tensors(v)]
    return []
