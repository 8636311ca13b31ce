"""An optimizer that handles GradScaler's scaling in its own step is stepped even on an overflow: its skip is read
from the ``found_inf`` GradScaler handed it, not from its step post-hook having fired. (torch's own fused optimizers
are refused: test_lightning_amp_contract.py's test_refuses_a_fused_optimizer_with_its_reason.)"""

import torch
from lightning_helpers import Classifier, StepRecorder, mlp_batches, quiet_trainer
from plain_amp_loop import make_mlp

from pl_lowprec import AMPPrecision


class ScalesInItsStep(torch.optim.Optimizer):
    """SGD that unscales and skips inside its step, as torch's fused kernels do, with no ``fused`` default for
    AMPPrecision to refuse it by (a third-party optimizer's way)."""

    _step_supports_amp_scaling = True

    def __init__(self, params, lr: float = 0.1) -> None:
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure=None):
        if self.found_inf.item():
            return None
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.sub_(group["lr"] * (p.grad if self.grad_scale is None else p.grad / self.grad_scale))
        return None


class WithScalesInItsStep(Classifier):
    def configure_optimizers(self):
        return ScalesInItsStep(self.parameters())


def test_a_step_the_optimizer_skipped_on_found_inf_is_counted_as_skipped():
    """GradScaler called step() with found_inf set, the optimizer applied nothing, and AMPPrecision counted the
    step as applied (its post-hook fired): 0 skipped steps, no back-off recorded, step-interval schedulers stepped."""
    plugin = AMPPrecision("16-mixed", init_scale=1024.0)
    recorder = StepRecorder()
    trainer = quiet_trainer(plugins=[plugin], max_steps=3, callbacks=[recorder])
    trainer.fit(WithScalesInItsStep(make_mlp(), overflow_at_steps=(1,)), mlp_batches(3))
    assert all(torch.equal(recorder.params[1][k], recorder.params[2][k]) for k in recorder.params[1])
    assert not torch.equal(recorder.params[2]["model.0.weight"], recorder.params[3]["model.0.weight"])
    state = plugin.loss_scale_state()
    assert (state.skipped_steps, state.optimizer_steps, state.scale) == (1, 3, 512.0)
