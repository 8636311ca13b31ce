"""The estimate simulates the optimizers the run builds (configure_optimizers on the fake parameters, with torch's
loop for the device; several under manual optimization, stepped by the module's training_step), against the
profiler's peak of the same step through Lightning's fit loop."""

import functools

import pytest
import torch
from fit_peak_helpers import ids_loader, measured_fit_peak

from pl_lowprec import LowPrecisionStrategy, estimate_memory
from pl_lowprec.demo import TinyLlama

ROWS, SEQ = 2, 16  # a small batch: the weights, gradients and optimizer state dominate, as in a full fine-tune


class WithOptimizer(TinyLlama):
    """TinyLlama whose ``configure_optimizers`` builds ``optimizer(trainable, **options)``."""

    def __init__(self, optimizer: type[torch.optim.Optimizer], options: dict, **sizes: int) -> None:
        super().__init__(**sizes)
        self.optimizer_class, self.options = optimizer, options

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return self.optimizer_class([p for p in self.parameters() if p.requires_grad], lr=1e-3, **self.options)


def _build(optimizer, options):
    sizes = {"hidden_size": 128, "intermediate_size": 256, "num_layers": 2, "max_len": SEQ}
    return functools.partial(WithOptimizer, optimizer, options, **sizes)


OPTIMIZERS = {  # state per fp32 trainable tensor: none; one buffer; three moments; two; two and a foreach copy
    "SGD": (torch.optim.SGD, {}),
    "SGD momentum": (torch.optim.SGD, {"momentum": 0.9}),
    "Adam amsgrad": (torch.optim.Adam, {"amsgrad": True}),
    "AdamW": (torch.optim.AdamW, {}),
    "AdamW foreach": (torch.optim.AdamW, {"foreach": True}),
}


@pytest.mark.parametrize("name", OPTIMIZERS, ids=str)
def test_the_estimate_is_the_measured_peak_for_each_optimizer(name):
    build = _build(*OPTIMIZERS[name])
    batch = {"input_ids": torch.zeros(ROWS, SEQ, dtype=torch.long)}
    estimate = estimate_memory(build, batch, precision="32-true", device="cpu")
    measured = measured_fit_peak(build, ids_loader(4, ROWS, SEQ), strategy=LowPrecisionStrategy())
    assert estimate.peak == pytest.approx(measured, rel=0.01), (estimate.peak, measured, estimate.table())
    assert estimate.optimizer.startswith(f"optimizer: {OPTIMIZERS[name][0].__name__} (")


def test_optimizer_state_is_what_each_optimizer_holds():
    batch = {"input_ids": torch.zeros(ROWS, SEQ, dtype=torch.long)}
    held = {}
    for name, (optimizer, options) in OPTIMIZERS.items():
        estimate = estimate_memory(_build(optimizer, options), batch, device="cpu")
        held[name] = estimate.optimizer_state
        tensors = len([p for p in _build(optimizer, options)().parameters() if p.requires_grad])
    gradients = estimate.gradients  # every model alike: fp32 weights, all trainable
    assert held["SGD"] == 0
    assert held["SGD momentum"] == gradients
    assert held["Adam amsgrad"] == 3 * gradients + 4 * tensors  # and one fp32 step each
    assert held["AdamW"] == held["AdamW foreach"] == 2 * gradients + 4 * tensors


def test_foreach_is_simulated_on_cuda_where_torch_picks_it():
    """torch picks the foreach loop for CUDA tensors: AdamW then holds an fp32 copy of every exp_avg_sq in its
    step; on a CPU it picks the single-tensor loop, unless foreach=True is given."""
    batch = {"input_ids": torch.zeros(ROWS, SEQ, dtype=torch.long)}

    def step_peak(device, options):
        estimate = estimate_memory(_build(torch.optim.AdamW, options), batch, device=device)
        return dict(estimate.timeline)["optimizer step peak"], estimate

    cpu, on_cpu = step_peak("cpu", {})
    forced, _ = step_peak("cpu", {"foreach": True})
    cuda, on_cuda = step_peak("cuda", {})
    single_on_cuda, _ = step_peak("cuda", {"foreach": False})
    assert "(single-tensor)" in on_cpu.optimizer and "(foreach)" in on_cuda.optimizer
    assert forced - cpu >= 0.7 * on_cpu.gradients  # a fp32 copy of the moments, less the single loop's temporaries
    assert cuda - single_on_cuda >= 0.7 * on_cuda.gradients


class NeedsATrainer(WithOptimizer):
    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=1e-3 / self.trainer.max_epochs)  # not on a dry-run trainer


def test_an_optimizer_that_cannot_be_built_on_fake_parameters_is_assumed_and_said():
    build = functools.partial(NeedsATrainer, torch.optim.SGD, {}, hidden_size=64, intermediate_size=128, max_len=SEQ)
    estimate = estimate_memory(build, {"input_ids": torch.zeros(ROWS, SEQ, dtype=torch.long)}, device="cpu")
    assert estimate.optimizer.startswith("optimizer assumed: AdamW (single-tensor): configure_optimizers failed")
    assert "AttributeError" in estimate.optimizer and estimate.optimizer in estimate.table()
    assert estimate.optimizer_state > 2 * estimate.gradients  # AdamW's two moments


def test_the_strategy_swap_refuses_what_the_run_refuses():
    build = _build(torch.optim.SGD, {})
    with pytest.raises(ValueError, match="replaces Adam or AdamW, but configure_optimizers returned SGD"):
        estimate_memory(build, {"input_ids": torch.zeros(ROWS, SEQ, dtype=torch.long)}, optimizer="adamw8bit")


class TwoOptimizers(TinyLlama):
    """Manual optimization, as Lightning runs several optimizers: AdamW over the blocks, SGD with momentum over the
    embedding; ``zero_grad_first`` as Lightning's docs write the step (the gradients held from the last step until
    the next backward, a scheduler stepped), else freed at the step's end."""

    def __init__(self, zero_grad_first: bool, **sizes: int) -> None:
        super().__init__(**sizes)
        self.automatic_optimization = False
        self.zero_grad_first = zero_grad_first

    def configure_optimizers(self):
        embedding = [p for name, p in self.named_parameters() if "embed" in name]
        blocks = [p for name, p in self.named_parameters() if "embed" not in name]
        adamw, sgd = torch.optim.AdamW(blocks, lr=1e-3), torch.optim.SGD(embedding, lr=1e-2, momentum=0.9)
        if not self.zero_grad_first:
            return adamw, sgd
        return [adamw, sgd], [torch.optim.lr_scheduler.StepLR(adamw, step_size=1)]

    def training_step(self, batch, batch_idx):
        optimizers = self.optimizers()
        loss = super().training_step(batch, batch_idx)
        loss = loss["loss"] if isinstance(loss, dict) else loss
        if self.zero_grad_first:
            for optimizer in optimizers:
                optimizer.zero_grad()
        self.manual_backward(loss)
        for optimizer in optimizers:
            optimizer.step()
        if self.zero_grad_first:
            self.lr_schedulers().step()
        else:
            for optimizer in optimizers:
                optimizer.zero_grad()
        return loss


def _two(zero_grad_first):
    sizes = {"hidden_size": 128, "intermediate_size": 256, "num_layers": 2, "max_len": SEQ}
    return functools.partial(TwoOptimizers, zero_grad_first, **sizes)


@pytest.mark.parametrize("zero_grad_first", [False, True], ids=["zero_grad-last", "zero_grad-first"])
def test_each_of_several_optimizers_is_simulated_over_its_own_parameters(zero_grad_first):
    build = _two(zero_grad_first)
    batch = {"input_ids": torch.zeros(ROWS, SEQ, dtype=torch.long)}
    estimate = estimate_memory(build, batch, precision="32-true", device="cpu")
    assert estimate.optimizer.startswith("2 optimizers: AdamW (single-tensor), SGD (single-tensor)")
    module = build()
    embedding = sum(p.numel() * 4 for name, p in module.named_parameters() if "embed" in name)
    blocks = [p for name, p in module.named_parameters() if "embed" not in name]
    # AdamW's two moments and fp32 step over the blocks, SGD's momentum over the embedding: not AdamW over all
    assert estimate.optimizer_state == 2 * sum(p.numel() * 4 for p in blocks) + 4 * len(blocks) + embedding
    held_at_start = dict(estimate.timeline)["after load"] - estimate.optimizer_state - sum(estimate.weights.values())
    assert (held_at_start >= estimate.gradients) is zero_grad_first  # else only the batch's ids
    measured = measured_fit_peak(build, ids_loader(4, ROWS, SEQ), optimizers=2, strategy=LowPrecisionStrategy())
    assert estimate.peak == pytest.approx(measured, rel=0.01), (estimate.peak, measured, estimate.table())


class TwoAutomatic(WithOptimizer):
    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=1e-3), torch.optim.SGD(self.parameters(), lr=1e-3)


def test_several_optimizers_under_automatic_optimization_are_assumed_and_said():
    """Lightning refuses the run; the estimate still gives one, on torch's AdamW, and says why."""
    build = functools.partial(TwoAutomatic, torch.optim.SGD, {}, hidden_size=64, intermediate_size=128, max_len=SEQ)
    estimate = estimate_memory(build, {"input_ids": torch.zeros(ROWS, SEQ, dtype=torch.long)}, device="cpu")
    assert estimate.optimizer.startswith("optimizer assumed: AdamW (single-tensor): configure_optimizers returned 2")
    assert "only under manual optimization" in estimate.optimizer
