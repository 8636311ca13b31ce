"""The optimizer a checkpoint's state belongs to, recorded when it is saved and checked when a run resumes.

A run that resumed with another ``optimizer=`` than the one that saved the checkpoint (bitsandbytes' 8-bit AdamW
and torch's AdamW keep different state: ``state1``/``qmap1`` against ``exp_avg``) printed "Restored all states"
and then failed inside the first step with a ``KeyError`` from the optimizer's kernel.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from torch.optim import Optimizer

from pl_lowprec._checks import ResumeRefused

CHECKPOINT_KEY = "pl_lowprec_optimizers"  # {"classes": [module.Class, ...], "optimizer": the strategy's optimizer=}


def class_path(optimizer: Optimizer) -> str:
    return f"{type(optimizer).__module__}.{type(optimizer).__qualname__}"


def library(path: str) -> str:
    """The library an optimizer class comes from, which decides the layout of its state."""
    top = path.split(".")[0]
    return top if top in ("bitsandbytes", "torchao") else "torch"


def state_kind(path: str) -> str:
    """What decides whether one optimizer's state loads into another: its library, and within it the update
    (bitsandbytes' paged and unpaged AdamW8bit keep the same state, as torch's Adam and AdamW do; Lion keeps one
    moment where AdamW keeps two)."""
    name = path.rpartition(".")[2].removeprefix("Paged")
    if library(path) == "torch" and name in ("Adam", "AdamW"):
        name = "Adam"
    return f"{library(path)}:{name}"


def optimizer_record(optimizers: Sequence[Optimizer], optimizer_name: str | None) -> dict[str, Any]:
    return {"classes": [class_path(o) for o in optimizers], "optimizer": optimizer_name}


def library_of_state(state: Mapping[str, Any]) -> str | None:
    """The library whose layout a saved optimizer state has, for checkpoints saved without a record."""
    per_param = [s for s in state.get("state", {}).values() if isinstance(s, Mapping)]
    if any("state1" in s or "__bnb_optimizer_quant_state__" in s for s in per_param):
        return "bitsandbytes"
    if any(type(v).__module__.startswith("torchao") for s in per_param for v in s.values()):
        return "torchao"
    if any("exp_avg" in s for s in per_param):
        return "torch"
    return None


def check_same_optimizer(checkpoint: Mapping[str, Any], optimizers: Sequence[Optimizer], name: str | None) -> None:
    """Refuse to load optimizer state saved by an optimizer of another library than the one this run steps."""
    record = checkpoint.get(CHECKPOINT_KEY)
    states = checkpoint.get("optimizer_states") or []
    saved_classes = list(record["classes"]) if record else [None] * len(states)
    for optimizer, state, saved in zip(optimizers, states, saved_classes, strict=False):
        if saved is not None:
            if state_kind(saved) == state_kind(class_path(optimizer)):
                continue
        else:  # saved before the record: its layout tells the library
            saved_library = library_of_state(state)
            if saved_library is None or saved_library == library(class_path(optimizer)):
                continue
        saved_name = f" (optimizer={record['optimizer']!r})" if record else ""
        said = f"{saved}'s" if saved else f"a {saved_library} optimizer's"
        again = f"optimizer={record['optimizer']!r}" if record else "the strategy's optimizer= as that run had it"
        raise ResumeRefused(
            f"The checkpoint's optimizer state is {said}{saved_name}, and this run steps {class_path(optimizer)}"
            f" (optimizer={name!r}): their states differ, and the first step would fail. Resume with the optimizer"
            f" the checkpoint trained with ({again}), or train anew without the checkpoint (no --ckpt_path)."
        )
