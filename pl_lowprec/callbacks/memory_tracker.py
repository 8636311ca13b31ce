"""``MemoryTracker``: per-stage memory peaks and an exact breakdown of where the memory went.

Peaks are reset at the start of each stage (fit, validate, test, predict), in ``setup``, before the model is
built, loaded and transformed (often a QLoRA run's peak), so a stage's peak includes its loading and a validate
run after fit reports its own peak. The breakdown walks the model and optimizer (``pl_lowprec.memory.breakdown``) and
counts the bytes saved for backward on one sampled training step (``pl_lowprec.memory.activations``). At the
end of each stage rank zero prints a table (max across ranks, and min where ranks differ), logs
``memory/<stage>/<figure>`` and writes ``memory_summary.json`` next to the logs.
"""

from __future__ import annotations

import json
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from pl_lowprec.callbacks.logger_step import batches_that_stepped, last_training_step_logged
from pl_lowprec.distributed.gather import gather_from_ranks
from pl_lowprec.memory.activations import count_saved_tensors
from pl_lowprec.memory.breakdown import buffer_bytes, gradient_bytes, optimizer_state_bytes, parameter_bytes
from pl_lowprec.memory.process import memory_stats, reset_peak

SUMMARY_FILE = "memory_summary.json"


class MemoryTracker(pl.Callback):
    """Tracks memory per stage; the result is in ``summary`` (bytes, as ints) and in ``memory_summary.json``.

    Args:
        activation_sample_step: The optimizer step whose first micro-batch is measured for activation bytes (and
            whose gradients are counted): the first batch that starts at or past it (with two manual optimizers
            ``global_step`` moves two a batch); a run resumed after it measures its own first step instead, and a
            run that ends before it says so.
        print_summary: Print the table at the end of each stage (rank zero).
    """

    def __init__(self, activation_sample_step: int = 0, print_summary: bool = True) -> None:
        if isinstance(activation_sample_step, bool) or activation_sample_step < 0:
            raise ValueError(f"MemoryTracker(activation_sample_step={activation_sample_step!r}) must be >= 0.")
        self.activation_sample_step = activation_sample_step
        self.print_summary = print_summary
        self._files: dict[Path, Path] = {}  # the file this tracker writes in each folder, its stages in one
        self.summary: dict[str, dict[str, Any]] = {}
        self._figures: dict[str, int] = {}
        self._peak_is_per_stage = True
        self._sampling = ExitStack()
        self._counter: Any = None
        self._gradients_pending = False  # the sampled batch began; its optimizer step has not come yet
        self._sample_step = activation_sample_step  # this run's: a resumed run may start after the one asked for

    # -- stage boundaries -------------------------------------------------------------------------------

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        device = trainer.strategy.root_device
        if device.type not in ("cpu", "cuda"):
            rank_zero_warn(
                f"MemoryTracker reports peaks for CPU and CUDA only; Trainer(accelerator=...) runs on {device.type},"
                " so only the model breakdown will be reported."
            )
        # Reset here, before configure_model and the strategy's setup: loading, quantizing and the LoRA transform
        # are often a QLoRA run's peak, and on_fit_start comes after them.
        self._start(trainer)

    def _start(self, trainer: pl.Trainer) -> None:
        self._figures = {}
        self._gradients_pending = False
        self._peak_is_per_stage = reset_peak(trainer.strategy.root_device)

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._finish(trainer, pl_module, "fit")

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.state.fn == "validate":
            self._finish(trainer, pl_module, "validate")

    def on_test_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._finish(trainer, pl_module, "test")

    def on_predict_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._finish(trainer, pl_module, "predict")

    # -- the sampled training step ----------------------------------------------------------------------

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._sample_step = max(self.activation_sample_step, trainer.global_step)  # restored by now

    def _is_sample_step(self, trainer: pl.Trainer) -> bool:
        # The first batch at or past the step: with two manual optimizers global_step is 0, 2, 4 at batch starts.
        return trainer.global_step >= self._sample_step and "activations" not in self._figures

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int):
        if self._is_sample_step(trainer) and self._counter is None:
            self._counter = self._sampling.enter_context(count_saved_tensors(pl_module))
            self._gradients_pending = True

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        if self._gradients_pending:  # the first step after the sampled batch began: its gradients
            self._gradients_pending = False
            self._figures["gradients"] = gradient_bytes(pl_module)

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        # Here, not before backward: the counter's hooks are closed outside the strategy's own (activation
        # offloading's, around a manual training_step), which closing them inside would pop. Saves made during
        # backward (reentrant checkpointing's recompute) are not counted (activations.in_backward).
        self._stop_sampling()

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._sampling.close()
        self._counter = None

    def _stop_sampling(self) -> None:
        if self._counter is not None:
            self._sampling.close()
            self._figures["activations"] = self._counter.nbytes
            if self._counter.offloaded_nbytes:  # activation offloading: these wait in host memory
                self._figures["activations_offloaded_to_host"] = self._counter.offloaded_nbytes
            self._counter = None

    # -- the summary ------------------------------------------------------------------------------------

    def _collect(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> dict[str, int]:
        figures = dict(memory_stats(trainer.strategy.root_device))
        for dtype, nbytes in parameter_bytes(pl_module).items():
            figures[f"params_{dtype}"] = nbytes
        figures["buffers"] = buffer_bytes(pl_module)
        if stage == "fit":
            figures["optimizer_state"] = optimizer_state_bytes(trainer.optimizers)
            figures.update(self._figures)
            if "activations" not in self._figures and trainer.global_step > 0:
                rank_zero_warn(
                    f"MemoryTracker(activation_sample_step={self.activation_sample_step}): the run ended at optimizer"
                    f" step {trainer.global_step} before reaching it, so there are no activations or gradients"
                    " figures. Pass a step the run reaches (0 measures the first)."
                )
        return figures

    def _finish(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        local = self._collect(trainer, pl_module, stage)
        keys = sorted(local)
        # On the strategy's device: NCCL gathers only CUDA tensors (gloo takes CPU ones, so CPU tests cannot tell).
        values = torch.tensor([local[k] for k in keys], dtype=torch.int64, device=trainer.strategy.root_device)
        per_rank = gather_from_ranks(values).cpu()
        high, low = per_rank.max(0).values.tolist(), per_rank.min(0).values.tolist()
        entry: dict[str, Any] = {
            "device": trainer.strategy.root_device.type,
            "world_size": trainer.world_size,
            "peak_is_per_stage": self._peak_is_per_stage,
            "bytes": dict(zip(keys, high, strict=True)),
        }
        differing = {k: lo for k, hi, lo in zip(keys, high, low, strict=True) if hi != lo}
        if differing:
            entry["min_bytes_across_ranks"] = differing
        self.summary[stage] = entry
        folder = Path(trainer.log_dir or trainer.default_root_dir)  # a collective: every rank must ask
        if not trainer.is_global_zero:
            return
        step = last_training_step_logged(trainer) if stage == "fit" else batches_that_stepped(trainer)
        for logger in trainer.loggers:
            logger.log_metrics({f"memory/{stage}/{k}": float(v) for k, v in entry["bytes"].items()}, step)
        self._write_json(folder)
        if self.print_summary:
            print(format_table(stage, entry))
            print(destinations(stage, self._files[folder], trainer.loggers))

    def _write_json(self, folder: Path) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        if folder not in self._files:
            self._files[folder] = unused_summary_path(folder)
        self._files[folder].write_text(json.dumps(self.summary, indent=2, sort_keys=True))


def unused_summary_path(folder: Path) -> Path:
    """``memory_summary.json``, or ``memory_summary-v1.json`` (``-v2``, ...) where an earlier run's is there: a
    run without a logger writes into ``default_root_dir``, which the next run shares. Versioned as Lightning's
    ``ModelCheckpoint`` versions a file name already taken."""
    path, version = folder / SUMMARY_FILE, 0
    while path.exists():
        version += 1
        path = folder / f"{Path(SUMMARY_FILE).stem}-v{version}.json"
    return path


def destinations(stage: str, summary_file: Path, loggers: list[Any]) -> str:
    """Where the table's figures went: the file always, the loggers if any (none under ``logger=False``)."""
    if loggers:
        logged = f"logged as memory/{stage}/* to {', '.join(type(logger).__name__ for logger in loggers)}"
    else:
        logged = "not logged (the Trainer has no logger)"
    return f"  Exact bytes in {summary_file}; {logged}."


def format_table(stage: str, entry: dict[str, Any]) -> str:
    """A plain table of one stage: figure, MiB and exact bytes (and the minimum across ranks if they differ)."""
    low = entry.get("min_bytes_across_ranks", {})
    ranks = entry["world_size"]
    lines = [f"Memory, {stage} ({entry['device']}, {ranks} rank{'s' if ranks > 1 else ''}, max across ranks)"]
    lines.append(f"  {'figure':<26}{'MiB':>12}{'bytes':>16}" + (f"{'min MiB':>12}" if low else ""))
    for key, value in entry["bytes"].items():
        row = f"  {key:<26}{value / 2**20:>12.2f}{value:>16d}"
        if key in low:
            row += f"{low[key] / 2**20:>12.2f}"
        lines.append(row)
    if not entry["peak_is_per_stage"]:
        lines.append("  (the CPU peak could not be reset: it is the peak since the process started)")
    return "\n".join(lines)
