"""Where a short step's time goes on a CPU: ``fit``'s median step against a plain PyTorch loop over the same
transformed model, and against the step-time prediction made before loading.

Run: python benchmarks/fit_vs_plain_loop.py [--steps 60] [--rounds 2]

Each workload is a ``Trainer.fit`` as the quickstart runs it (``LowPrecisionStrategy``, nf4-dq, LoRA r=8, ``"auto"``
settings, ``AMPPrecision("auto")``, ``LossScaleMonitor``, ``MemoryTracker`` and a CSV logger), whose median step
(``StepClock``) and prediction come from the strategy. The plain loop then trains the same model with the same
optimizer and scheduler on the same batches, with only what a step needs: the precision plugin's autocast,
forward, backward, ``step``, ``zero_grad``. Their ratio is what Lightning's loop, the callbacks and the logger add;
what the plain loop takes beyond the prediction is what the prediction leaves out of the step itself.

- quickstart: ``configs/quickstart.yaml``'s TinyLlama (hidden 128, 2 layers, batch 8 x 128);
- host floor: the same at hidden 64 and batch 1 x 16, where the kernels take almost nothing, so its step is the
  host's work: the modules' Python (Hugging Face's modeling code, peft, bitsandbytes), autograd and dispatch.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import tempfile
import time
import warnings
from typing import Any

import torch
from common import describe_machine, machine_info, markdown_table, quiet_trainer, section, write_json
from cpu_step_prediction import HOST_FLOOR, QUICKSTART
from cpu_step_prediction import _tiny as quickstart_shaped
from lightning.pytorch.loggers import CSVLogger

from pl_lowprec import AMPPrecision, LossScaleMonitor, LowPrecisionStrategy, MemoryTracker
from pl_lowprec.demo import StdlibTextDataModule, TinyLlama

warnings.filterwarnings("ignore")

WORKLOADS = {  # cpu_step_prediction's shapes: hidden, MLP, heads, sequence length, batch
    "quickstart (TinyLlama 128, 2 layers, 8 x 128)": QUICKSTART,
    "host floor (TinyLlama 64, 2 layers, 1 x 16)": HOST_FLOOR,
}


def _fit(shape: tuple[int, ...], steps: int, log_dir: str) -> tuple[Any, Any, Any]:
    torch.manual_seed(0)
    model, data, settings = quickstart_shaped(*shape)  # cpu_step_prediction's quickstart
    strategy = LowPrecisionStrategy(activation_checkpointing="auto", memory_saving="auto", **settings)
    trainer = quiet_trainer(
        accelerator="cpu",
        max_steps=steps,
        limit_val_batches=0,
        plugins=[AMPPrecision("auto")],
        strategy=strategy,
        callbacks=[LossScaleMonitor(), MemoryTracker()],
        logger=CSVLogger(log_dir),
        log_every_n_steps=10,
    )
    trainer.fit(model, datamodule=data)
    return trainer, model, data


def _plain_loop_median(trainer: Any, model: TinyLlama, data: StdlibTextDataModule, steps: int) -> float:
    """The median step of a loop over the fitted model, its optimizer and scheduler, timed as ``StepClock`` times
    fit's: from the end of one step to the end of the next, leaving out the first 2."""
    optimizer, scheduler = trainer.optimizers[0], trainer.lr_scheduler_configs[0].scheduler
    batches = iter(data.train_dataloader())
    ends = []
    for _ in range(steps):
        ids = next(batches)["input_ids"]
        with trainer.precision_plugin.forward_context():
            loss = model.model(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()
        ends.append(time.perf_counter())
    return statistics.median(b - a for a, b in itertools.pairwise(ends[2:]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    info = machine_info()
    rows, results = [], {}
    for name, shape in WORKLOADS.items():
        fits, plains, predictions = [], [], []
        for _ in range(args.rounds):
            with tempfile.TemporaryDirectory() as log_dir:
                trainer, model, data = _fit(shape, args.steps, log_dir)
                predicted = trainer.strategy.prediction.step_time
                fits.append(trainer.strategy.step_clock.median)
                plains.append(_plain_loop_median(trainer, model, data, args.steps))
                predictions.append(predicted.seconds)
        fit, plain, prediction = (statistics.median(v) for v in (fits, plains, predictions))
        results[name] = {"fit": fits, "plain": plains, "predicted": predictions, "kernels": predicted.launches}
        rows.append([name, predicted.launches, prediction, fit, plain, fit / plain, plain / prediction])
    section("fit against a plain loop over the same model, and the prediction")
    print(describe_machine(info))
    print(f"{args.rounds} rounds of {args.steps} steps; medians over the rounds")
    headers = ["workload", "kernels", "predicted s", "fit s", "plain loop s", "fit / plain", "plain / predicted"]
    print(markdown_table(headers, rows))
    write_json("fit_vs_plain_loop", {"machine": info, "results": results})


if __name__ == "__main__":
    main()
