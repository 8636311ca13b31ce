"""LLaMA-Factory's ShareGPT tool-use turns as the chat template's: ``function_call`` and ``observation``.

LLaMA-Factory's ShareGPT format (its ``glaive_toolcall`` data) has, beside ``human``/``gpt``/``system``, the roles
``function_call`` (the assistant's call: a JSON ``{"name": ..., "arguments": {...}}``, or a list of them) and
``observation`` (what the tool returned). LLaMA-Factory trains on the calls as on the answers, and reads the
observations as context. Passed on under their own names, a generic template wrote them as any role
(``<|im_start|>function_call``), one that names its roles dropped them, and the calls were not trained. Here, as
Hugging Face's chat templates take tool use: a call is an assistant turn with ``tool_calls`` (trained, as every
assistant turn), an observation a ``tool`` turn (a rename, in ``fields.SHAREGPT_ROLES``, as ``human`` is
``user``). A call whose value is not such JSON keeps its role, which the data module then counts as unusable, naming
it.
"""

from __future__ import annotations

import json
from typing import Any

FUNCTION_CALL = "function_call"


def tool_use_turn(role: str, value: Any) -> dict[str, Any] | None:
    """The chat template's turn for a ShareGPT ``function_call`` turn; ``None`` for any other role, or for a call
    whose value is not the JSON of one or more calls."""
    if role != FUNCTION_CALL:
        return None
    calls = tool_calls(value)
    return {"role": "assistant", "tool_calls": calls} if calls else None


def tool_calls(value: Any) -> list[dict[str, Any]] | None:
    """``value`` (JSON text, or the parsed object) as Hugging Face's ``tool_calls``, or ``None``."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            return None
    calls = value if isinstance(value, list) else [value]
    if not calls or not all(isinstance(call, dict) and isinstance(call.get("name"), str) for call in calls):
        return None
    return [
        {"type": "function", "function": {"name": call["name"], "arguments": call.get("arguments", {})}}
        for call in calls
    ]
