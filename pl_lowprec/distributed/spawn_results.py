"""Rank 0's trained weights back in the main process under ``lowprec_ddp_spawn``, with the layers they fit.

Lightning's spawn launcher saves rank 0's ``state_dict`` after ``fit`` and loads it into the main process's module
with ``strict=False``, since a worker may have changed the module. Here it always has: the main process's module
never ran the strategy's transform, so it has no LoRA layers and full-precision base weights, and every adapter
(and quantized weight) was dropped without a word: after ``trainer.fit(model)`` the model in hand was the
untrained one. ``TransformingSpawnLauncher`` applies the same transform to the main process's module first, on the
CPU (where Lightning's launcher leaves it), then loads the weights. Every parameter that trains must be among them;
where that, or the transform on the CPU (fp8, offloading), fails, a warning says the model in hand is untrained and
where the weights are, instead of a silent drop. A quantized layer's packed weight is quantized from the same weights on
both sides, and bitsandbytes' quantization-state entries, which its CPU layers do not take back, are left out.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.strategies.launchers.multiprocessing import _MultiProcessingLauncher, _WorkerOutput
from lightning.pytorch.utilities.rank_zero import rank_zero_warn


class TransformingSpawnLauncher(_MultiProcessingLauncher):
    """Lightning's ``_MultiProcessingLauncher``; the main process's module is transformed before rank 0's weights
    load into it."""

    def _recover_results_in_main_process(self, worker_output: _WorkerOutput, trainer: pl.Trainer) -> None:
        if worker_output.weights_path is not None:
            strategy: Any = self._strategy
            module = trainer.lightning_module
            try:
                strategy.transform.apply(module, strategy.precision_plugin, torch.device("cpu"))
                load_trained_weights(module, strategy.checkpoint_io.load_checkpoint(worker_output.weights_path))
            except Exception as err:  # fp8 or offloading, which need CUDA: the model in hand cannot take them
                rank_zero_warn(
                    f"lowprec_ddp_spawn: the trained weights could not come back into the model in this process"
                    f" ({type(err).__name__}: {err}), so it is the untrained model. The run's checkpoints hold them;"
                    " strategy='lowprec_ddp' (a process per rank) leaves nothing to bring back."
                )
            strategy.checkpoint_io.remove_checkpoint(worker_output.weights_path)
            worker_output = worker_output._replace(weights_path=None)
        super()._recover_results_in_main_process(worker_output, trainer)


def load_trained_weights(module: torch.nn.Module, weights: dict[str, torch.Tensor]) -> None:
    """Rank 0's ``weights`` into ``module``; a parameter that trains and is not among them is an error."""
    trains = [name for name, parameter in module.named_parameters() if parameter.requires_grad]
    lacking = [name for name in trains if name not in weights]
    if lacking:
        raise RuntimeError(
            f"lowprec_ddp_spawn: rank 0's weights lack {len(lacking)} of the {len(trains)} trained parameters of the"
            f" model in this process ({lacking[:3]}...), so they cannot come back into it; the run's checkpoints"
            " hold them."
        )
    module.load_state_dict(weights, strict=False)
