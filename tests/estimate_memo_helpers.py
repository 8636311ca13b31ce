"""One simulation per distinct estimate within a test: a test that plans the same model several times (once per
budget, or the CLI run twice) asks ``estimate_memory`` the same question again, and a fake step costs seconds."""

import inspect
from typing import Any

import pytest
import torch

from pl_lowprec.memory.estimate import estimate_memory
from pl_lowprec.memory.fake_step import batch_tensors


def estimates_once(
    monkeypatch: pytest.MonkeyPatch,
    *modules: Any,
    memo: list[tuple[tuple, Any]] | None = None,
    by_model: bool = False,
) -> list[tuple[tuple, Any]]:
    """Patch ``estimate_memory`` where ``modules`` call it with a memo of ``(arguments, estimate)``, the arguments
    compared by value (every one but the model builder: each test builds one model; the batch by its tensors'
    shapes and dtypes). A list, not a dict keyed by ``repr``: equal sets may print in another order. Returns the
    memo (``memo`` where given: one shared with an earlier call), so a test can say how many simulations ran.
    ``by_model``: the model the builder makes is compared too, by its class, hyperparameters and layers (a test
    whose configs could build different models: a CLI run builds the config's)."""
    signature = inspect.signature(estimate_memory)
    memo = [] if memo is None else memo

    def once(*args: Any, **kwargs: Any) -> Any:
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        arguments = dict(bound.arguments)
        build = arguments.pop("build_model")
        batch = arguments.pop("example_batch")
        if arguments["device"] is not None:  # "cpu" and torch.device("cpu") alike
            arguments["device"] = torch.device(arguments["device"])
        key = (arguments, [(t.shape, t.dtype) for t in batch_tensors(batch)])
        if by_model:
            with torch.device("meta"):
                model = build()
            key += (type(model), dict(getattr(model, "hparams", {})), repr(model))
        for asked, estimate in memo:
            if asked == key:
                return estimate
        memo.append((key, estimate_memory(*args, **kwargs)))
        return memo[-1][1]

    for module in modules:
        monkeypatch.setattr(module, "estimate_memory", once)
    return memo
