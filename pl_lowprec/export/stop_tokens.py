"""The token ids ``pl-lowprec generate`` stops at: what transformers' own ``generate`` stops at, and the chat
template's end of an assistant turn, as the GGUF export's Modelfile stops there for Ollama.

Passing only the tokenizer's EOS replaced the model's ``generation_config`` list (Llama-3.x-Instruct lists three
ids, Qwen2.5-Instruct two), and a base model fine-tuned with a chat template whose turn ends at a token other than
its EOS (``<|im_end|>`` beside ``<|endoftext|>``) then wrote the next turn into its completion.
"""

from __future__ import annotations

from typing import Any

from pl_lowprec.data.chat import special_token_texts
from pl_lowprec.export.modelfile import chat_parts
from pl_lowprec.loading.generation_config import generation_default


def configured_ids(value: Any) -> list[int]:
    """An ``eos_token_id`` as transformers allows it (``None``, an int or a list of ints) as a list."""
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, (list, tuple)) else [int(value)]


def end_of_turn_id(tokenizer: Any) -> int | None:
    """The special token that ends an assistant turn in ``tokenizer``'s chat template (``<|im_end|>``,
    ``<|eot_id|>``), or ``None`` where the template has no such token or cannot be read as fixed turns."""
    parts = chat_parts(tokenizer, add_bos=False)
    if parts is None:
        return None
    suffix = parts.suffix["assistant"].strip()
    if not suffix or suffix not in special_token_texts(tokenizer):
        return None
    return tokenizer.convert_tokens_to_ids(suffix)


def stop_token_ids(model: Any, tokenizer: Any) -> list[int]:
    """The ids generation stops at, each once: the model's ``generation_config``, the tokenizer's EOS and the
    chat template's end-of-turn token."""
    found = [
        *configured_ids(generation_default(model, "eos_token_id")),
        *configured_ids(tokenizer.eos_token_id),
        *configured_ids(end_of_turn_id(tokenizer)),
    ]
    return list(dict.fromkeys(found))
