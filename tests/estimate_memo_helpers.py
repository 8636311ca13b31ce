"""One simulation per distinct estimate within a test: a test that plans the same model several times (once per
budget, or the CLI run twice) asks ``estimate_memory`` the same question again, and a fake step costs seconds."""

import inspect
from typing import Any

import pytest
import torch

from pl_lowprec.memory.estimate import estimate_memory
from pl_lowprec.memory.fake_step import batch_tensors


def estimates_once(monkeypatch: pytest.MonkeyPatch, *modules: Any) -> dict[tuple, Any]:
    """Patch ``estimate_memory`` where ``modules`` call it with a memo keyed by every argument but the model
    builder (each test builds one model) and by the batch's tensor shapes and dtypes; returns the memo, so a test
    can say how many simulations ran."""
    signature = inspect.signature(estimate_memory)
    memo: dict[tuple, Any] = {}

    def once(*args: Any, **kwargs: Any) -> Any:
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        arguments = dict(bound.arguments)
        arguments.pop("build_model")
        batch = arguments.pop("example_batch")
        if arguments["device"] is not None:  # "cpu" and torch.device("cpu") alike
            arguments["device"] = torch.device(arguments["device"])
        key = (repr(arguments), tuple((t.shape, t.dtype) for t in batch_tensors(batch)))
        if key not in memo:
            memo[key] = estimate_memory(*args, **kwargs)
        return memo[key]

    for module in modules:
        monkeypatch.setattr(module, "estimate_memory", once)
    return memo
