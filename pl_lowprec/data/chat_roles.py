"""Chat turns whose role the template does not know, or whose text or tool calls it does not write.

A chat template writes a role it does not handle in one of two ways, both silent: a generic template (ChatML's
``<|im_start|>{{ role }}``) writes it as a role of its own, which the model learns and never meets at inference
(``human`` beside ``assistant``, LLaMA-Factory's ``observation``); a template that names its roles (Zephyr's
``if role == 'user' ... elif role == 'assistant'``) writes nothing for it, and the turn is gone from what trains.
TRL passes such roles to the template; LLaMA-Factory drops a conversation with a role out of place ("Invalid role
tag"), and axolotl's chat_template strategy maps roles through its ``roles`` table. Here a record is unusable, named
by its role and the rename, where a role is neither one every tool-using template reads (``system``, ``user``,
``assistant``, ``tool``) nor named in the template's source (Llama-3.1's ``ipython``, GLM-4's ``observation``); and
where the rendered conversation lacks a context turn's text or an assistant's tool call's name.
"""

from __future__ import annotations

import re
from typing import Any

STANDARD_ROLES = ("system", "user", "assistant", "tool")
# the answers in other data ("Assistant"); ShareGPT dumps name some by the model that wrote them
ANSWER_ROLES = ("assistant", "model", "gpt", "bot", "ai", "chatbot", "chatgpt", "bing", "bard")
RENAMES = {
    **dict.fromkeys(("human", "usr", "question", "prompter"), "user"),
    # not "assistant" itself: a role "Assistant" is told the standard roles, not renamed to what it seems to be
    **dict.fromkeys((*(role for role in ANSWER_ROLES if role != "assistant"), "answer"), "assistant"),
    **dict.fromkeys(("observation", "function", "ipython", "tool_response", "function_response"), "tool"),
}


def named_in(template: str, role: str) -> bool:
    """Whether ``template``'s source names ``role`` as a quoted string (``'ipython'``): it handles that role."""
    return re.search(rf"""['"]{re.escape(role)}['"]""", template) is not None


def unknown_role_reason(turns: list[dict[str, Any]], template: str) -> str | None:
    """Why a record with a turn of a role the ``template`` (its source) does not know is unusable, or ``None``."""
    roles = dict.fromkeys(turn["role"] for turn in turns)
    unknown = [role for role in roles if role not in STANDARD_ROLES and not named_in(template, role)]
    if not unknown:
        return None
    role = unknown[0]
    rename = RENAMES.get(role.lower())
    if role == "function_call":
        fix = (
            "write each call as an assistant turn's tool_calls ([{'type': 'function', 'function': {'name': ...,"
            " 'arguments': {...}}}]); in ShareGPT's {from, value} turns a function_call whose value is JSON"
            " {'name': ..., 'arguments': {...}} is read so"
        )
    elif rename:
        fix = f"rename the role {role!r} to {rename!r}"
    else:
        fix = f"rename it to one of {list(STANDARD_ROLES)}, or use --data.tokenizer with a template that names it"
    return (
        f"records with turns of role {role!r}, which the chat template does not name (roles read: "
        f"{', '.join(STANDARD_ROLES)}, and those the template names): it would write the turn as a role of its own"
        f" or drop it: {fix}"
    )


def unwritten_turn_reason(turns: list[dict[str, Any]], rendered: str) -> str | None:
    """Why a record is unusable whose ``rendered`` conversation lacks a context turn's text (a template that drops
    the roles it does not handle) or an assistant's tool call (a template that writes ``content`` only), or
    ``None``. Assistant texts are left out: a template may rewrite them (Qwen3 drops earlier reasoning)."""
    written = loosely(rendered)
    for turn in turns:
        content = turn.get("content")
        if turn["role"] != "assistant" and isinstance(content, str) and loosely(content) not in written:
            return (
                f"records with a {turn['role']!r} turn whose text the chat template does not write (it drops the"
                f" turns of roles it does not handle): rename the role to one it writes, or use --data.tokenizer"
                " with a template that writes it"
            )
        for call in turn.get("tool_calls") or []:
            name = call.get("function", {}).get("name") if isinstance(call, dict) else None
            if isinstance(name, str) and name not in rendered:
                return (
                    f"records with an assistant tool call ({name!r}) the chat template does not write (it writes"
                    " the turn's content only), so the call would not be trained: use --data.tokenizer with a"
                    " template that writes tool_calls (Qwen2.5's, Llama-3.1's), or write the call as the turn's"
                    " content"
                )
    return None


def loosely(text: str) -> str:
    """``text`` with its whitespace runs as one space and its case folded: what a template's ``trim`` or ``upper``
    leaves of a turn's text, so that only a turn left out counts as not written."""
    return " ".join(text.split()).casefold()


def unwritten_tools_reason(tools: list[Any] | None, rendered: str) -> str | None:
    """Why a record whose ``tools`` the template does not write (one with no tools section drops them) is
    unusable, or ``None``: its tool calls would train without the definitions the model is given at inference."""
    for tool in tools or []:
        spec = tool.get("function", tool)  # {"type": "function", "function": {...}}, or LLaMA-Factory's schema alone
        name = spec.get("name") if isinstance(spec, dict) else None
        if isinstance(name, str) and name not in rendered:
            return (
                f"records with tools ({name!r}) the chat template does not write (it has no tools section), so they"
                " would train without the definitions: use --data.tokenizer with a template that writes tools"
                " (Qwen2.5's, Llama-3.1's), or leave the field out"
            )
    return None
