"""Activation checkpointing for any ``nn.Module``, chosen by module class, class name or a predicate.

``set_activation_checkpointing(model, policy)`` replaces the ``forward`` of each selected block with a
``CheckpointedForward`` that recomputes the block in backward instead of keeping its activations. No module is
wrapped or renamed, so ``state_dict`` keys, ``named_parameters`` and ``isinstance`` checks stay exactly as
they were: checkpoints move freely between runs with and without checkpointing.

``mode="full"`` recomputes the whole block; ``mode="selective"`` keeps its matmul and attention outputs and
recomputes the rest (``selective_checkpointing.py``; non-reentrant only).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from typing import Any, Literal

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from pl_lowprec.memory.activations import note_checkpoint_inputs
from pl_lowprec.transforms.checkpoint_cache import without_cache
from pl_lowprec.transforms.selective_checkpointing import selective_contexts, traced_full_checkpoint_args

CheckpointPolicy = type[nn.Module] | str | Iterable[type[nn.Module] | str] | Callable[[nn.Module, str], bool]
CheckpointImpl = Literal["non_reentrant", "reentrant"]
CheckpointMode = Literal["full", "selective"]


class CheckpointedForward:
    """A module's ``forward``, recomputed during backward; plain ``forward`` when no grad is being recorded.
    ``compiled``: the block is compiled (``compile=``), and full recompute is tagged op by op where torch does not
    (``traced_full_checkpoint_args``); eager blocks keep plain checkpointing, without a dispatch mode on every op."""

    def __init__(self, forward: Callable[..., Any], impl: CheckpointImpl, mode: CheckpointMode = "full") -> None:
        self.forward = forward
        self.impl = impl
        self.mode = mode
        self.compiled = False

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return self.forward(*args, **kwargs)
        kwargs = without_cache(self.forward, kwargs)  # the recompute would write a KV cache a second time
        if not torch.compiler.is_compiling():  # a compiled block saves its inputs through autograd, counted there
            note_checkpoint_inputs([*args, *kwargs.values()])
        if self.impl == "non_reentrant":
            # torch.compile traces checkpoint() only without a context_fn or with a plain function, as these are
            if self.mode == "selective":
                return checkpoint(self.forward, *args, use_reentrant=False, context_fn=selective_contexts, **kwargs)
            traced = traced_full_checkpoint_args() if self.compiled else {}
            return checkpoint(self.forward, *args, use_reentrant=False, **traced, **kwargs)
        # Reentrant checkpointing takes positional tensors only and returns no grad if none requires one,
        # which silently freezes the block when the embeddings are frozen (LoRA; transformers #26221).
        return checkpoint(functools.partial(self.forward, **kwargs), *_with_grad_input(args), use_reentrant=True)


def _with_grad_input(args: tuple[Any, ...]) -> tuple[Any, ...]:
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    if any(t.requires_grad for t in tensors):
        return args
    for i, arg in enumerate(args):
        if isinstance(arg, torch.Tensor) and arg.is_floating_point():
            return (*args[:i], arg.detach().requires_grad_(), *args[i + 1 :])
    return args


def is_checkpointed(module: nn.Module) -> bool:
    return isinstance(module.__dict__.get("forward"), CheckpointedForward)


def select_modules(
    model: nn.Module, policy: CheckpointPolicy, argument: str = "activation_checkpointing"
) -> list[tuple[str, nn.Module]]:
    """The outermost modules that ``policy`` selects, in ``named_modules`` order.

    Raises ``ValueError`` when the policy, or any class or class name in it, selects nothing, listing the
    classes the model contains: a typo in a YAML file must not turn checkpointing silently off.
    """
    items = _policy_items(policy)
    unmatched = [i for i in items if not any(_item_matches(i, m) for m in model.modules())] if items else []
    matches = policy if items is None else (lambda module, _name: any(_item_matches(i, module) for i in items))
    selected: list[tuple[str, nn.Module]] = []
    for name, module in model.named_modules():
        if module is model or any(name.startswith(f"{outer}.") for outer, _ in selected):
            continue
        if matches(module, name):
            selected.append((name, module))
    if unmatched or not selected:
        what = _describe(unmatched) if unmatched else getattr(policy, "__name__", repr(policy))
        classes = sorted({type(m).__name__ for m in model.modules()})
        raise ValueError(
            f"{argument}: {what} matches no module of {type(model).__name__}."
            f" The model contains these classes: {', '.join(classes)}. Name the repeated block, for example"
            " the decoder layer class."
        )
    return selected


def set_activation_checkpointing(
    model: nn.Module,
    policy: CheckpointPolicy,
    every_n: int = 1,
    impl: CheckpointImpl = "non_reentrant",
    mode: CheckpointMode = "full",
) -> list[str]:
    """Checkpoint every ``every_n``-th selected block (idempotent); return the names of checkpointed blocks."""
    validate_checkpoint_args(every_n, impl, mode)
    chosen = select_modules(model, policy)[::every_n]
    for _, module in chosen:
        if not is_checkpointed(module):
            module.forward = CheckpointedForward(module.forward, impl, mode)
    return [name for name, _ in chosen]


def declared_blocks(model: nn.Module) -> list[str]:
    """The repeated block classes a model declares (Hugging Face's ``_no_split_modules``): what
    ``activation_checkpointing="auto"`` checkpoints."""
    return sorted({n for m in model.modules() for n in (getattr(m, "_no_split_modules", None) or ())})


def resolved_blocks(model: nn.Module, policy: CheckpointPolicy | Literal["auto"] | None) -> CheckpointPolicy | None:
    """``policy`` with ``"auto"`` (``activation_checkpointing="auto"`` not chosen yet, or the FSDP shard units taken
    from it) read as every block the model declares, or ``None`` where it declares none."""
    if policy == "auto":
        return declared_blocks(model) or None
    return policy


def remove_activation_checkpointing(model: nn.Module) -> None:
    for module in model.modules():
        if is_checkpointed(module):
            del module.forward


def validate_checkpoint_args(every_n: int, impl: str, mode: str = "full") -> None:
    if isinstance(every_n, bool) or not isinstance(every_n, int) or every_n < 1:
        raise ValueError(
            f"checkpoint_every_n={every_n!r} is not valid: use an integer >= 1 (1 checkpoints every selected"
            " block; 2 every other block, trading memory back for speed)."
        )
    if impl not in ("non_reentrant", "reentrant"):
        raise ValueError(f"checkpoint_impl={impl!r} is not valid: use 'non_reentrant' (default) or 'reentrant'.")
    if mode not in ("full", "selective"):
        raise ValueError(
            f"checkpoint_mode={mode!r} is not valid: use 'full' (default: recompute each checkpointed block whole)"
            " or 'selective' (keep its matmul and attention outputs, recompute the rest)."
        )
    if mode == "selective" and impl == "reentrant":
        raise ValueError(
            "checkpoint_mode='selective' with checkpoint_impl='reentrant': selective checkpointing chooses which op"
            " outputs to keep through torch.utils.checkpoint's context_fn, which only non-reentrant checkpointing"
            " runs. Use checkpoint_impl='non_reentrant' (the default), or checkpoint_mode='full'."
        )


def _policy_items(policy: CheckpointPolicy) -> list[type[nn.Module] | str] | None:
    """The classes and class names of a policy; ``None`` for a predicate."""
    if isinstance(policy, (str, type)):
        return [policy]
    if callable(policy) and not isinstance(policy, Iterable):
        return None
    items = list(policy)
    for item in items:
        if not isinstance(item, (str, type)):
            raise TypeError(
                f"activation_checkpointing got {item!r}: give module classes, class names such as"
                " 'LlamaDecoderLayer', or a callable (module, name) -> bool."
            )
    return items


def _item_matches(item: type[nn.Module] | str, module: nn.Module) -> bool:
    """A class name matches the module's class or a base of it, as a class matches by ``isinstance``: after
    ``fully_shard`` a ``LlamaDecoderLayer`` is an ``FSDPLlamaDecoderLayer``, and ``compile=`` selects it then."""
    if isinstance(item, str):
        return any(cls.__name__ == item for cls in type(module).__mro__)
    return isinstance(module, item)


def _describe(items: list[type[nn.Module] | str]) -> str:
    return ", ".join(repr(i.__name__ if isinstance(i, type) else i) for i in items)
