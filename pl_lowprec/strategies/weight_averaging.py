"""Lightning's weight-averaging callbacks refused where the strategy changes the model's parameters.

``StochasticWeightAveraging`` and ``WeightAveraging`` (``EMAWeightAveraging``) copy the module in their ``setup``
hook, which Lightning calls before the strategy's: the copy has the user's ``nn.Linear`` layers, not the 4-bit
ones or the LoRA adapters the transform puts in, and not FSDP2's shards. They then average the two modules'
parameters pairwise, in order: the pairs stop matching at the first adapted layer, and the fit fails inside the
callback with torch's ``The size of tensor a (256) must match the size of tensor b (64)``, after a training
epoch (SWA) or batch (EMA), where it does not average unrelated tensors of equal shape. Lightning refuses SWA on its
own sharded strategies for the same reason.
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch.callbacks import StochasticWeightAveraging

from pl_lowprec.strategies.trainer_checks import first_callback
from pl_lowprec.transforms.config import TransformConfig

try:  # Lightning 2.5+
    from lightning.pytorch.callbacks import WeightAveraging
except ImportError:  # pragma: no cover - older Lightning has SWA only
    WeightAveraging = StochasticWeightAveraging

AVERAGING = (StochasticWeightAveraging, WeightAveraging)


def check_weight_averaging(trainer: Any, config: TransformConfig, sharded: bool) -> None:
    """``ValueError`` (one paragraph) where a weight-averaging callback would average another module than the
    one that trains: under ``lora=``, ``quantization=`` or FSDP2 sharding."""
    averaging = first_callback(trainer, AVERAGING)
    changes = [
        what
        for what, on in (
            ("lora=", config.lora is not None),
            ("quantization=", config.quantization is not None),
            ("FSDP2 sharding (lowprec_fsdp)", sharded),
        )
        if on
    ]
    if averaging is None or not changes:
        return
    name = type(averaging).__name__
    full_fine_tune = (
        "lowprec or lowprec_ddp without lora= and quantization="
        if sharded
        else "the same strategy without lora= and quantization="
    )
    raise ValueError(
        f"Trainer(callbacks=[{name}(...)]) cannot average this model: it copies the module in its setup hook,"
        f" before the strategy changes its layers ({', '.join(changes)}), then averages that copy's parameters"
        " pairwise against the trained ones, which no longer match (the fit would fail inside the callback with"
        " 'The size of tensor a ... must match the size of tensor b', after training). Remove the callback (LoRA"
        f" and QLoRA recipes train without it), or average a full fine-tune: {full_fine_tune} runs it as Lightning"
        " does."
    )
