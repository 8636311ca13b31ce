"""Whether the optimizer step that just ran applied its update: asked from the optimizer's step post-hook.

GradScaler skips a plain optimizer's ``step()`` on an overflow, so a post-hook that runs saw an applied step. An
optimizer that handles the scaling itself (``_step_supports_amp_scaling``: torch's fused Adam, AdamW and SGD) is
stepped even on an overflow: GradScaler sets ``optimizer.found_inf`` (and ``grad_scale``) for the step, its
kernel skips the update when found_inf is nonzero, and the post-hook fires all the same. Counting every hook as
an applied step counted such a skip as trained.
"""

from __future__ import annotations

import torch
from torch.optim import Optimizer


def step_applied(optimizer: Optimizer) -> bool | torch.Tensor:
    """Called from ``optimizer``'s step post-hook: ``True``, or for an optimizer GradScaler handed a ``found_inf``
    a 0-dim bool tensor (``found_inf == 0``) on the scaler's device, which ``bool()`` reads; holding it until the
    batch ends spares the fused step a host sync."""
    found_inf = getattr(optimizer, "found_inf", None)
    if isinstance(found_inf, torch.Tensor):
        return found_inf == 0
    return True
