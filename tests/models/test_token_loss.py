"""Token-normalised loss: a window's gradient is that of one big batch's mean over every target token,
across gradient accumulation (1 process) and across ranks (2 DDP CPU processes)."""

import sys
from pathlib import Path

import pytest
import torch
import warm_python
from lightning_helpers import quiet_trainer
from token_loss_helpers import TokenMeanLlama, big_batch_loss, big_batch_step, uneven_rows

pytest.importorskip("transformers")


def _accumulated_step(token_mean: bool, rows) -> dict[str, torch.Tensor]:
    model = TokenMeanLlama(token_mean=token_mean)
    trainer = quiet_trainer(max_steps=1, accumulate_grad_batches=4)
    trainer.fit(model, torch.utils.data.DataLoader(rows, batch_size=2))
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, model.step_losses


def test_accumulation_equals_one_big_batch():
    rows = uneven_rows(8)
    reference = big_batch_step(rows)
    accumulated, step_losses = _accumulated_step(True, rows)
    for key, value in reference.items():
        torch.testing.assert_close(accumulated[key], value, rtol=1e-5, atol=1e-6)
    # the loss the step optimized, as normalize_gradients returns it: the big batch's
    assert step_losses == pytest.approx([float(big_batch_loss(TokenMeanLlama(False), rows))], rel=1e-6)
    # Lightning's mean of per-micro-batch means is measurably different on these rows: the test can tell.
    plain, _ = _accumulated_step(False, rows)
    diff = max((plain[k] - reference[k]).abs().max().item() for k in reference)
    assert diff > 1e-3


class GradientsBeforeNormalizing(TokenMeanLlama):
    """Keeps the window's accumulated gradients as backward left them: what an fp16 scaler's overflow check sees."""

    def on_before_optimizer_step(self, optimizer) -> None:
        self.accumulated = {n: p.grad.clone() for n, p in self.named_parameters() if p.grad is not None}
        super().on_before_optimizer_step(optimizer)


def test_backward_carries_the_magnitude_of_the_plain_loops_mean_loss():
    """Each micro-batch's backward is ``mean / k``, as in the plain loop and Hugging Face's: an fp16 loss scale
    overflows where theirs does, not at a scale ``k`` times lower. Rows with equal token counts make it exact."""
    rows = [{**row, "labels": row["input_ids"].clone()} for row in uneven_rows(8)]
    grads = {}
    for token_mean in (True, False):
        model = GradientsBeforeNormalizing(token_mean=token_mean)
        quiet_trainer(max_steps=1, accumulate_grad_batches=4).fit(
            model, torch.utils.data.DataLoader(rows, batch_size=2)
        )
        grads[token_mean] = model.accumulated
    for name, plain in grads[False].items():
        torch.testing.assert_close(grads[True][name], plain, rtol=1e-5, atol=1e-7, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.slow
def test_two_ddp_processes_equal_one_big_batch(tmp_path):
    script = Path(__file__).parents[1] / "_scripts" / "token_loss_ddp.py"
    helpers = script.parents[1]  # token_loss_helpers.py, beside the tests
    result = warm_python.run([sys.executable, str(script), str(tmp_path)], timeout=300, ranks=2, pythonpath=helpers)
    assert result.returncode == 0, result.stderr[-4000:]
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in (0, 1)]
    reference = big_batch_step(uneven_rows(8))
    loss = float(big_batch_loss(TokenMeanLlama(False), uneven_rows(8)))
    assert ranks[0].pop("step_losses") == ranks[1].pop("step_losses") == pytest.approx([loss], rel=1e-6)
    for key, value in reference.items():
        torch.testing.assert_close(ranks[0][key], ranks[1][key], rtol=0, atol=0)
        torch.testing.assert_close(ranks[0][key], value, rtol=1e-5, atol=1e-6)
