"""Find the module where a non-finite value first appears, in forward or in backward.

The hooks cost a finiteness check per module, so they are armed only after an overflow has been seen and
disarmed once the next optimizer step is over: healthy training runs without them. In forward, a module's
output is checked as the module returns (innermost modules return first). In backward, the gradient with
respect to a module's input is checked: the first one that is not finite was produced by that module.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle


@dataclass(frozen=True)
class OverflowLocation:
    module: str
    phase: str  # "forward" or "backward"
    dtype: torch.dtype
    rank: int | None = None  # the process that saw it, where several train

    def __str__(self) -> str:
        what = "output" if self.phase == "forward" else "input gradient"
        on_rank = f" on rank {self.rank}" if self.rank is not None else ""
        return f"{self.module!r} ({type_name(self.dtype)} {what} in {self.phase}){on_rank}"


def type_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in _tensors(v)]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _tensors(v)]
    return []


def _first_nonfinite(tensors: list[torch.Tensor]) -> torch.Tensor | None:
    for t in tensors:
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            return t
    return None


class OverflowLocator:
    """Arm with ``arm(model)``; after a step, ``location`` holds the first non-finite site (or ``None``)."""

    def __init__(self) -> None:
        self.location: OverflowLocation | None = None
        self._handles: list[RemovableHandle] = []
        self._located_grad: weakref.ref[torch.Tensor] | None = None  # never an id(): a freed one's is reused

    @property
    def armed(self) -> bool:
        return bool(self._handles)

    def arm(self, model: nn.Module) -> None:
        self.disarm()
        self.location = None
        self._located_grad = None
        for name, module in model.named_modules():
            if module is model:
                continue
            self._handles.append(module.register_forward_pre_hook(self._pre_hook(name), with_kwargs=True))
            self._handles.append(module.register_forward_hook(self._post_hook(name)))

    def disarm(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _post_hook(self, name: str):
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            if self.location is None and (bad := _first_nonfinite(_tensors(output))) is not None:
                self.location = OverflowLocation(name, "forward", bad.dtype)

        return hook

    def _pre_hook(self, name: str):
        def hook(module: nn.Module, args: Any, kwargs: Any) -> None:
            if not torch.is_grad_enabled():
                return
            for tensor in _tensors((args, kwargs)):
                if tensor.requires_grad and tensor.is_floating_point():
                    tensor.register_hook(self._grad_hook(name))

        return hook

    def _grad_hook(self, name: str):
        def hook(grad: torch.Tensor) -> None:
            # Hooks on one tensor fire outer module first; an inner module sharing the input names it better.
            located = self._located_grad() if self._located_grad is not None else None
            same_grad = self.location is not None and located is grad
            if (self.location is None or same_grad) and _first_nonfinite([grad]) is not None:
                self.location = OverflowLocation(name, "backward", grad.dtype)
                self._located_grad = weakref.ref(grad)

        return hook
