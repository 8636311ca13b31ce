"""What ``TextDataModule(packing=True)`` asks of the LightningModule: a declaration at setup, then proof.

At setup a module that does not declare ``accepts_packed_batches = True`` is refused. Declaring is not enough: a
module that calls its Hugging Face model with a cache (``use_cache`` not ``False`` on a config with
``use_cache: true``, as most hub models have) or an ``attention_mask`` lets each sample attend to the ones before
it, and the loss still falls. So on the first packed training batch of each fit, and on the first validation batch
(the sanity check's, when there is one), before the step runs, ``pl_lowprec.data.isolation_check`` runs the step
on one row twice, with the tokens before a sample changed, and a sample whose outputs moved stops the run with the
likely cause and the fix. ``CausalLM`` is not checked: its path is tested against unpacked batches
(``tests/models/test_packed_equivalence.py``); a subclass that overrides ``forward``, ``loss_sum``,
``training_step`` or ``validation_step`` is.

Under DDP or FSDP every process runs the check's forwards together (FSDP gathers weights in them), and every
process stops when one found a leak.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from lightning.pytorch.utilities.signature_utils import is_param_in_hook_signature

from pl_lowprec.data.isolation_check import (
    IsolationResult,
    ModelCall,
    ProbeRow,
    check_isolation,
    hf_models,
    probe_row,
    sample_bounds,
)
from pl_lowprec.models.causal_lm import CausalLM

HOW = (
    "batches of input_ids, labels and position_ids that restart at 0 for each sample and no attention_mask;"
    " the model must get batch['position_ids'], no attention_mask and use_cache=False (with a cache, transformers"
    " does not cut attention where the positions restart)"
)
FIX = (
    "Call the model as pl_lowprec.models.forward_batch(self.model, batch, labels=batch['labels']) does"
    " (input_ids, position_ids=batch['position_ids'], no attention_mask, use_cache=False), use"
    " pl_lowprec.models.CausalLM, or set packing=False (--data.packing false)."
)
CAUSAL_LM_PATH = ("forward", "loss_sum", "training_step", "validation_step")


def check_accepts_packed_batches(module: pl.LightningModule | None) -> None:
    """Packing is refused for a module that does not declare it takes packed batches (``None``: no module yet)."""
    if module is None or getattr(module, "accepts_packed_batches", False):
        return
    name = class_name(module)
    raise ValueError(
        f"TextDataModule(packing=True) puts several samples in each row, with {HOW}. {name} does not declare that"
        f" its training_step takes such batches (class attribute accepts_packed_batches = True). Use"
        f" pl_lowprec.models.CausalLM; or call your Hugging Face model with"
        f" pl_lowprec.models.forward_batch(self.model, batch, labels=batch['labels']) (or pass position_ids, no"
        f" attention_mask and use_cache=False yourself) and set {name}.accepts_packed_batches = True (the first"
        f" packed batch then checks that samples stay apart); or set packing=False (--data.packing false)."
    )


def tested_causal_lm(module: pl.LightningModule) -> bool:
    """``CausalLM`` with its own path from batch to model, which the packed-equivalence tests cover."""
    return isinstance(module, CausalLM) and all(
        getattr(type(module), name) is getattr(CausalLM, name) for name in CAUSAL_LM_PATH
    )


class PackingGuard:
    """Refuses an undeclared module; then checks, once per fit, that its training and validation steps keep the
    samples of a packed row apart (``check``, called for each packed batch once it is on the device)."""

    def __init__(self, module: pl.LightningModule | None) -> None:
        check_accepts_packed_batches(module)
        self.pending = {"training_step", "validation_step"}
        self.results: dict[str, IsolationResult] = {}  # what each check saw, by step
        self.models: list[torch.nn.Module] | None = None

    def check(self, trainer: pl.Trainer, batch: Any) -> None:
        step_name = "training_step" if trainer.training else "validation_step"
        if not (trainer.training or trainer.validating or trainer.sanity_checking) or step_name not in self.pending:
            return
        module = trainer.lightning_module
        check_accepts_packed_batches(module)
        if tested_causal_lm(module):
            self.pending.clear()
            return
        if self.models is None:  # the model as it trains: after configure_model and the strategy's transforms
            self.models = hf_models(module)
        models = self.models
        if not models:
            self.pending.clear()
            rank_zero_warn(
                f"TextDataModule(packing=True) cannot check that {class_name(module)} keeps packed samples apart:"
                " it holds no Hugging Face model (transformers.PreTrainedModel) whose per-token outputs the check"
                " compares. Its accepts_packed_batches = True is trusted as declared."
            )
            return
        probe = probe_row(batch)
        if not trainer.strategy.reduce_boolean_decision(probe is not None, all=False):
            return  # no row of any process holds two samples: the next batch
        self.pending.discard(step_name)
        result = check_isolation(
            step_function(trainer, module, step_name), batch, probe or ProbeRow(0, 1, 2), module, models
        )
        self.results[step_name] = result
        leaked = probe is not None and result.observed and not result.keeps_apart
        if trainer.strategy.reduce_boolean_decision(leaked, all=False):
            raise ValueError(leak_message(class_name(module), step_name, result, batch, leaked))
        describe(class_name(module), step_name, result if probe is not None else None)


def class_name(obj: object) -> str:
    """The user's class name, not that of the subclass FSDP2's ``fully_shard`` makes of it (``FSDP<Name>``)."""
    cls = type(obj)
    base = cls.__bases__[-1]
    return base.__name__ if cls.__name__ == f"FSDP{base.__name__}" else cls.__name__


def step_function(trainer: pl.Trainer, module: pl.LightningModule, step_name: str):
    """``module``'s step on a batch (as the first batch), in the precision context Lightning runs it in."""
    plugin = trainer.precision_plugin
    context = plugin.train_step_context if step_name == "training_step" else plugin.val_step_context

    method = getattr(module, step_name)
    takes_index = is_param_in_hook_signature(method, "batch_idx", min_args=2)  # as Lightning's loops decide

    def step(batch: dict[str, Any]) -> Any:
        with context():
            return method(batch, 0) if takes_index else method(batch)

    return step


def describe(name: str, step_name: str, result: IsolationResult | None) -> None:
    """The check's outcome in the log: passed, or could not see the outputs it compares."""
    if result is None:
        return
    if result.observed:
        rank_zero_info(
            f"TextDataModule(packing=True): {name}.{step_name} keeps packed samples apart: with the"
            f" {result.probe.start} tokens before a sample changed, its {result.compared} positions' outputs did not"
            " move (checked once per fit)."
        )
        return
    rank_zero_warn(
        f"TextDataModule(packing=True) could not check that {name}.{step_name} keeps packed samples apart: the step"
        " called no Hugging Face model with the batch's tokens, or its output had no per-token tensor"
        " (last_hidden_state or logits). Its accepts_packed_batches = True is trusted as declared."
    )


def leak_message(name: str, step_name: str, result: IsolationResult, batch: Any, here: bool) -> str:
    """One paragraph: what moved, the likely cause seen in the model call, the fix."""
    if here:
        seen = (
            f"with the {result.probe.start} tokens before a sample of a packed row changed, {result.moved} of its"
            f" {result.compared} positions' outputs moved (by up to {result.change:.2g} of their size)"
        )
    else:
        seen = "on another process, a sample's outputs moved when the tokens before it in its packed row changed"
    cause, fix = likely_cause(result.call, batch["position_ids"][result.probe.row : result.probe.row + 1])
    return (
        f"TextDataModule(packing=True) stopped the run before {name}.{step_name} ran on a packed batch, because it"
        f" lets the samples of a row attend to each other: {seen}. {cause} {fix}"
    )


def likely_cause(call: ModelCall | None, position_ids: torch.Tensor) -> tuple[str, str]:
    """The reason that the model call the check recorded shows, and the fix."""
    if call is None:
        return "The step called no Hugging Face model.", FIX
    model, kwargs = class_name(call.model), call.kwargs
    config = getattr(call.model, "config", None)
    causes = []
    if kwargs.get("attention_mask") is not None:
        causes.append(
            f"It passes an attention_mask to {model}: with a mask, transformers does not cut attention where"
            " position_ids restart."
        )
    if kwargs.get("past_key_values") is not None or kwargs.get("use_cache") is True:
        causes.append(f"It calls {model} with a cache (past_key_values or use_cache=True).")
    elif kwargs.get("use_cache") is not False and getattr(config, "use_cache", False):
        causes.append(
            f"It calls {model} without use_cache=False, and the model's config has use_cache=True: transformers then"
            " makes a cache even in training, and with a cache it does not derive the block-causal mask from"
            " restarting position_ids."
        )
    passed = kwargs.get("position_ids")
    if passed is None and call.positional <= 2:
        causes.append(f"It does not pass batch['position_ids'] to {model}, so nothing marks where samples start.")
    elif torch.is_tensor(passed) and not _same_samples(passed, position_ids):
        causes.append(f"The position_ids it passes to {model} are not batch['position_ids'].")
    if causes:
        return " ".join(causes), FIX
    attention = getattr(config, "_attn_implementation", None)
    return (
        f"{model} got batch['position_ids'], no attention_mask and use_cache=False, so the model itself ignores"
        f" restarting position_ids (attn_implementation={attention!r}: custom modeling code, or an attention that"
        " does not build transformers' packed-sequence mask).",
        "Set packing=False (--data.packing false) for this model.",
    )


def _same_samples(passed: torch.Tensor, position_ids: torch.Tensor) -> bool:
    """Whether ``passed`` (any broadcastable shape) restarts where the batch's positions do."""
    if passed.shape[-1] != position_ids.shape[-1]:
        return False
    return sample_bounds(passed.reshape(-1, passed.shape[-1])[0].cpu()) == sample_bounds(position_ids[0].cpu())
