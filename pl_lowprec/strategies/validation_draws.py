"""A fit's ``validation_step`` draws from random generators of its own, so that validating leaves the training's
draws as they were.

A ``validation_step`` may draw from the global generators (sampled generations, a stochastic metric). During a fit
those draws shift every later training draw (dropout masks), so a resumed run draws the uninterrupted run's masks
only where it makes the same validations after the checkpoint. It does not always: restarted where a validation
followed the checkpoint (a step save on the validation grid), Lightning 2.6 skips that validation as pending, and
the masks of the resumed run's every later step differed. ``skipped_validation.py`` replays what the loaders draw
there; what the module itself draws cannot be replayed without running it.

So each ``validation_step`` of a fit draws from a stream of its own: begun, at the validation's first step, from the
generators as they stood, continued across the validation's steps, and set aside after each one, giving the
generators back to the training as they stood before it. A validation draws the numbers it drew before; training
no longer depends on whether one ran.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from pl_lowprec.generator_states import generators_held, random_states


class ValidationDraws:
    """The random states of one validation's steps, kept between them."""

    def __init__(self) -> None:
        self._states: dict[str, Any] | None = None  # none yet: the first step begins from the training's

    @contextmanager
    def drawing(self) -> Iterator[None]:
        """The block draws from this validation's stream; the generators stand as before it afterwards."""
        with generators_held(self._states):  # none on the first step: it begins from the training's
            try:
                yield
            finally:
                self._states = random_states()
