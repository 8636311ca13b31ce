"""The transformers ``Trainer`` run that Hugging Face's contender (``train_once.py --stack hf``) and Unsloth's
(``unsloth_once.py``) share: AdamW (lr 1e-3, weight decay 0.01), clipping at 1.0, a constant LR, the rows in order
(no shuffling), one logged loss and one timed step (between device synchronizations) per optimizer step.
transformers is imported when ``train`` runs, not with this module: Unsloth has to be imported before it."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

LR, WEIGHT_DECAY, CLIP = 1e-3, 0.01, 1.0


def synchronize() -> None:
    """Step times on a GPU are taken between synchronizations: device work is asynchronous."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def train(
    model: Any,
    rows: list[dict[str, torch.Tensor]],
    *,
    batch: int,
    steps: int,
    precision: str,
    output_dir: str,
    on_step: Callable[[str, int], None] | None = None,
) -> tuple[list[float], list[float]]:
    """Trains ``model`` for ``steps`` optimizer steps of ``batch`` rows; returns each step's seconds and the logged
    losses. ``on_step("begin" | "end", global_step)`` runs inside each step's timing (a profiler's start or stop)."""
    from transformers import Trainer, TrainerCallback, TrainingArguments

    times: list[float] = []
    losses: list[float] = []

    class Record(TrainerCallback):
        def on_step_begin(self, _args: Any, state: Any, *a: Any, **k: Any) -> None:
            synchronize()
            self.start = time.perf_counter()
            if on_step is not None:
                on_step("begin", state.global_step)

        def on_step_end(self, _args: Any, state: Any, *a: Any, **k: Any) -> None:
            if on_step is not None:
                on_step("end", state.global_step)
            synchronize()
            times.append(time.perf_counter() - self.start)

        def on_log(self, _args: Any, state: Any, control: Any, logs: dict | None = None, **k: Any) -> None:
            if logs and "loss" in logs:
                losses.append(float(logs["loss"]))

    class InOrder(Trainer):
        """The same batch order as the other contenders (no shuffling)."""

        def _get_train_sampler(self, *a: Any, **k: Any) -> torch.utils.data.Sampler:
            return torch.utils.data.SequentialSampler(self.train_dataset)

    arguments = TrainingArguments(
        output_dir=output_dir,
        per_device_train_batch_size=batch,
        max_steps=steps,
        learning_rate=LR,
        weight_decay=WEIGHT_DECAY,
        max_grad_norm=CLIP,
        lr_scheduler_type="constant",
        optim="adamw_torch",
        bf16=precision == "bf16-mixed",
        fp16=precision == "16-mixed",
        use_cpu=not torch.cuda.is_available(),
        logging_steps=1,
        report_to=[],
        save_strategy="no",
        dataloader_num_workers=0,
        disable_tqdm=True,
        seed=0,
    )
    InOrder(model=model, args=arguments, train_dataset=rows, callbacks=[Record()]).train()
    return times, losses
