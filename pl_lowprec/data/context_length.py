"""``seq_len`` against the model's context, checked before any record is read.

A model with learned position embeddings (GPT-2, OPT) has none past ``max_position_embeddings``: a longer sample
fails inside the model with "index out of range" (on a GPU, a device-side assert that poisons the process), so such
a ``seq_len`` is refused. Rotary models (Llama, Qwen, Mistral) compute any position, but never saw those past it in
pretraining: a warning says so.
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from pl_lowprec.adapters import held_hf_model


def model_config(module: Any) -> Any:
    """The Hugging Face config of the model a module holds: its own ``config`` (``CausalLM`` has it before its model
    is built), else its ``PreTrainedModel``'s; ``None`` where it holds none."""
    own = getattr(module, "config", None)
    if hasattr(own, "max_position_embeddings"):
        return own
    return getattr(held_hf_model(module), "config", None)


def check_seq_len_with_model(trainer: Any, seq_len: int) -> None:
    """Refuse a ``seq_len`` past a model's learned positions; say so where rotary positions would extrapolate."""
    module = getattr(trainer, "lightning_module", None) if trainer is not None else None
    config = model_config(module) if module is not None else None
    limit = getattr(config, "max_position_embeddings", None)
    if not isinstance(limit, int) or seq_len <= limit:
        return
    name = getattr(config, "model_type", type(config).__name__)
    if getattr(config, "rope_parameters", None) is not None or hasattr(config, "rope_theta"):
        rank_zero_warn(
            f"TextDataModule(seq_len={seq_len}) is past the model's max_position_embeddings={limit} ({name}): its"
            f" rotary positions past {limit} were never seen in pretraining. Long-context fine-tuning usually"
            " extends them first (rope_scaling in the model's config)."
        )
        return
    raise ValueError(
        f"TextDataModule(seq_len={seq_len}) is past the model's {limit} learned positions ({name}:"
        f" max_position_embeddings={limit}): a longer sample would fail inside the model with 'index out of range'."
        f" Pass --data.seq_len {limit} or less."
    )
