"""This process's random generators (torch, CUDA, NumPy, Python) as plain tensors and numbers, and set again.

The one place that knows which generators a training step may draw from: the strategies keep every rank's states in
the checkpoint (``strategies/random_states.py``), and ``StepBoundaryCheckpoint`` keeps them where a step ends
(``callbacks/step_end_rewind.py``); ``generators_held`` keeps a block's draws out of the run's sequence.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np  # torchmetrics, which Lightning requires, requires it
import torch


def random_states() -> dict[str, Any]:
    """This process's generator states, as ``weights_only`` loads them (NumPy's key array as a tensor)."""
    version, internal, gauss = random.getstate()
    states: dict[str, Any] = {"torch": torch.get_rng_state(), "python": [version, list(internal), gauss]}
    if torch.cuda.is_available() and torch.cuda.is_initialized():  # this rank's device: each rank draws on its own
        states["cuda"] = torch.cuda.get_rng_state()
    name, keys, position, has_gauss, cached = np.random.get_state()
    states["numpy"] = [name, torch.from_numpy(keys.astype(np.int64)), position, has_gauss, cached]
    return states


def set_random_states(states: dict[str, Any]) -> None:
    """Set what ``random_states`` returned (a generator it did not hold is left as it is)."""
    torch.set_rng_state(states["torch"])
    version, internal, gauss = states["python"]
    random.setstate((version, tuple(internal), gauss))
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state(states["cuda"])
    if "numpy" in states:
        name, keys, position, has_gauss, cached = states["numpy"]
        np.random.set_state((name, keys.numpy().astype(np.uint32), position, has_gauss, cached))


@contextmanager
def generators_held(states: dict[str, Any] | None = None) -> Iterator[None]:
    """The random generators set to ``states`` (where given) for the block, and given back their own after it:
    whatever the block draws leaves the run's generators where they stood."""
    own = random_states()
    if states is not None:
        set_random_states(states)
    try:
        yield
    finally:
        set_random_states(own)
