"""``pl-lowprec generate`` completes prompts with a causal LM; a classifier (trained with LoRA task_type SEQ_CLS,
or its merged or adapter export) scores text and writes none. transformers would load a merged classifier as a
causal LM all the same (its ``score`` dropped, the base's ``lm_head`` in its place) and generate from the base
model the fine-tune never changed, so each of these is refused before anything loads, as is a GGUF export of it
(llama.cpp would serve the base)."""

from __future__ import annotations

import json
from pathlib import Path

from torch import nn

TASKS_WITHOUT_TEXT = ("SEQ_CLS", "TOKEN_CLS", "QUESTION_ANS", "FEATURE_EXTRACTION")  # peft task types
GENERATE = "pl-lowprec generate completes prompts with a causal LM (AutoModelForCausalLM)"
GGUF = "a GGUF file holds a causal LM, for llama.cpp and Ollama to complete text with"


def _refusal(subject: str, load_with: str, needs: str = GENERATE) -> ValueError:
    return ValueError(
        f"{subject}, which scores text and has no generate(): {needs}. Load this one with {load_with} to run it on"
        " text, or generate from a model trained as a causal LM."
    )


def check_module_generates(model: nn.Module | None, holder: str, needs: str = GENERATE) -> None:
    """The Hugging Face model a checkpoint's module holds can ``generate`` (``None``: not known yet)."""
    if model is not None and not callable(getattr(model, "generate", None)):
        kind = type(model).__name__
        raise _refusal(f"{holder} holds a {kind}", f"{kind}.from_pretrained on its `pl-lowprec export --merged`", needs)


def check_directory_generates(path: Path) -> None:
    """An exported directory: a merged model whose ``config.json`` names only classes that cannot generate, or a
    peft adapter for a task without text (``task_type``), is refused."""
    adapter_config = path / "adapter_config.json"
    if adapter_config.is_file():
        task = json.loads(adapter_config.read_text()).get("task_type")
        if task in TASKS_WITHOUT_TEXT:
            raise _refusal(
                f"--model {str(path)!r} is a peft adapter for task_type {task!r}",
                "peft's AutoPeftModelForSequenceClassification (or its task's class)",
            )
        return
    config = path / "config.json"
    if not config.is_file():
        return
    names = json.loads(config.read_text()).get("architectures") or []
    if none_generates(names):
        raise _refusal(
            f"--model {str(path)!r} is a {names[0]} (config.json's architectures)", f"{names[0]}.from_pretrained"
        )


def none_generates(architectures: list[str]) -> bool:
    """Whether ``architectures`` (a ``config.json``'s) names only transformers classes that cannot generate (a
    classifier, a base model without a head); ``False`` for none named or a class transformers does not have."""
    import transformers  # optional (pl_lowprec[hf]); its callers need it

    classes = [getattr(transformers, name, None) for name in architectures]
    return bool(classes) and all(c is not None and hasattr(c, "can_generate") and not c.can_generate() for c in classes)
