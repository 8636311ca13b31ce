"""Where autograd sums two gradients of one parameter (tied weights), in place as the real engine does.

A parameter used twice (tied input embedding and output head) gets two gradients in backward, which the engine
sums in the parameter's input buffer (``torch/csrc/autograd/input_buffer.cpp``): in place into the first one
when the buffer holds its only reference and it is a plain dense tensor, else into a new tensor. Fake tensors
are a tensor subclass, for which the engine always makes the new tensor, so a fake step held one more gradient
of the embedding (vocabulary x hidden) at that moment than the real step: SmolLM2's 49,152 x 576 fp32 gradient,
113 MB, in a 2-layer full fine-tune (its backward peak then sat at that sum: +13% over the profiler's).
Here that sum runs in place. Only sums the engine issues itself (no Python frame of a backward between) of two
tensors shaped as a trainable parameter are taken: activation-shaped sums (the residual stream's) stay as the
engine makes them for fake tensors, since there the first gradient is often shared with the other branch.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch

ENGINE_FRAME = "_engine_run_backward"  # torch.autograd.graph: the Python frame the engine is entered from
TORCH_DIRECTORY = str(Path(torch.__file__).parent)


def sums_gradients_of_a_parameter(func: Any, args: tuple, kwargs: dict | None, shapes: set[tuple]) -> bool:
    """Whether ``func(*args)`` is the engine summing two gradients of a parameter shaped as one of ``shapes``."""
    if func is not torch.ops.aten.add.Tensor or kwargs or len(args) != 2:
        return False
    first, second = args
    if not (isinstance(first, torch.Tensor) and isinstance(second, torch.Tensor)):
        return False
    same = first.shape == second.shape and first.dtype == second.dtype and tuple(first.shape) in shapes
    return same and first.is_contiguous() and not first._is_view() and _issued_by_the_engine()


def _issued_by_the_engine() -> bool:
    """The innermost Python frames are torch's own, up to the engine's entry: no backward written in Python
    (a custom Function's, this package's chunked loss) and no model code (a checkpointed block's recompute)."""
    frame = sys._getframe(3)  # past this function, its caller and the dispatch mode's handler
    while frame is not None and frame.f_code.co_filename.startswith(TORCH_DIRECTORY):
        if frame.f_code.co_name == ENGINE_FRAME:
            return True
        frame = frame.f_back
    return False
