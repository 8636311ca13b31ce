"""An Ollama ``Modelfile`` for a GGUF export: ``FROM`` the file, the chat template as a Go template, stop tokens.

Ollama's templates are Go templates, the tokenizer's are Jinja, and no general translation exists. Most chat
templates wrap each turn in a fixed prefix and suffix per role (ChatML, Llama 3, Zephyr-like ones such as the
demo's), so the template is rendered on probe conversations and those strings are read off the output:

- each role's prefix and suffix, the generation prompt, and the text before the first turn (a ``bos_token``
  written by the template is dropped there, since llama.cpp adds BOS itself when ``add_bos_token`` says so);
- a default system turn that the template adds when the conversation has none (Qwen2.5's).

The Go template built from them is checked by rendering it (``render_go``, the same parts in Python) against the
Jinja template on several conversations; when they differ (a template that merges the system prompt into the
first user turn, or numbers turns), the Modelfile gets no ``TEMPLATE`` and the export says so: Ollama then
chooses a template from the GGUF's ``tokenizer.chat_template``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

ROLES = ("system", "user", "assistant")
MARKS = {"system": "PROBESYSTEMTEXT", "user": "PROBEUSERTEXT", "assistant": "PROBEASSISTANTTEXT"}


@dataclass(frozen=True)
class ChatParts:
    """The fixed strings around each turn, read off the rendered template."""

    start: str  # before the first turn, less ``dropped``
    dropped: str  # the template's own BOS, dropped because llama.cpp adds BOS itself
    prefix: dict[str, str]
    suffix: dict[str, str]
    generation: str  # add_generation_prompt's text
    default_system: str | None  # the system turn's content the template adds when there is none

    def stops(self, eos: str | None) -> list[str]:
        """Stop strings: EOS, the assistant turn's end, the start of a user turn (each once, none empty)."""
        found = [eos, self.suffix["assistant"].strip(), self.prefix["user"].strip()]
        return [s for i, s in enumerate(found) if s and s not in found[:i]]


def _render(tokenizer: Any, messages: list[dict[str, str]], generation: bool) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation)


def _turn(role: str, index: int = 1) -> dict[str, str]:
    return {"role": role, "content": f"{MARKS[role]}{index}"}


def _between(text: str, before: str, after: str) -> str:
    start = text.index(before) + len(before)
    return text[start : text.index(after, start)]


def chat_parts(tokenizer: Any, add_bos: bool) -> ChatParts | None:
    """The parts of ``tokenizer``'s chat template, or None when it cannot be read as fixed strings per role.
    ``add_bos``: llama.cpp adds BOS to every prompt (the GGUF's ``add_bos_token``), so a template's own is dropped."""
    if not getattr(tokenizer, "chat_template", None):
        return None
    u1, a1, u2, s1 = _turn("user"), _turn("assistant"), _turn("user", 2), _turn("system")
    try:
        one = _render(tokenizer, [u1], False)
        prompt = _render(tokenizer, [u1], True)
        reply = _render(tokenizer, [u1, a1], False)
        two = _render(tokenizer, [u1, a1, u2], False)
        system = _render(tokenizer, [s1, u1], False)
    except Exception:  # a template that refuses a probe (e.g. only alternating roles) cannot be read
        return None
    if not prompt.startswith(one) or u1["content"] not in one:
        return None
    try:
        user_suffix = one[one.index(u1["content"]) + len(u1["content"]) :]
        assistant_prefix = _between(reply, u1["content"], a1["content"]).removeprefix(user_suffix)
        assistant_suffix = reply[reply.index(a1["content"]) + len(a1["content"]) :]
        user_prefix = _between(two, a1["content"], u2["content"]).removeprefix(assistant_suffix)
        before_user = one[: one.index(u1["content"])].removesuffix(user_prefix)
        system_prefix_full = system[: system.index(s1["content"])]
        system_suffix = _between(system, s1["content"], u1["content"]).removesuffix(user_prefix)
    except ValueError:
        return None
    bos = getattr(tokenizer, "bos_token", None) or ""
    dropped = bos if add_bos and bos and before_user.startswith(bos) else ""
    start = before_user.removeprefix(dropped)
    system_prefix = system_prefix_full.removeprefix(dropped)
    default_system = None
    if start and start.startswith(system_prefix) and start.endswith(system_suffix):
        default_system = start[len(system_prefix) : len(start) - len(system_suffix)]
        start = ""
    elif start and system_prefix.startswith(start):
        system_prefix = system_prefix[len(start) :]
    return ChatParts(
        start=start,
        dropped=dropped,
        prefix={"system": system_prefix, "user": user_prefix, "assistant": assistant_prefix},
        suffix={"system": system_suffix, "user": user_suffix, "assistant": assistant_suffix},
        generation=prompt[len(one) :],
        default_system=default_system,
    )


def render_go(parts: ChatParts, messages: list[dict[str, str]]) -> str:
    """What ``go_template(parts)`` renders for ``messages`` in Ollama (the same parts and branches, in Python)."""
    text = parts.start
    if parts.default_system is not None and messages[0]["role"] != "system":
        text += parts.prefix["system"] + parts.default_system + parts.suffix["system"]
    for i, message in enumerate(messages):
        role = message["role"]
        text += parts.prefix[role] + message["content"] + parts.suffix[role]
        if i == len(messages) - 1 and role != "assistant":
            text += parts.generation
    return text


def go_template(parts: ChatParts) -> str:
    """The Go template (Ollama's ``.Messages`` form). No whitespace trimming: every string is as rendered."""
    default = ""
    if parts.default_system is not None:
        default = (
            '{{ if ne (index .Messages 0).Role "system" }}'
            f"{parts.prefix['system']}{parts.default_system}{parts.suffix['system']}{{{{ end }}}}"
        )
    branches = "".join(
        f'{{{{ {"if" if i == 0 else "else if"} eq .Role "{role}" }}}}'
        f"{parts.prefix[role]}{{{{ .Content }}}}{parts.suffix[role]}"
        for i, role in enumerate(ROLES)
    )
    return (
        f"{parts.start}{default}{{{{ range $i, $_ := .Messages }}}}"
        "{{ $last := eq (len (slice $.Messages $i)) 1 }}"
        f"{branches}{{{{ end }}}}"
        f'{{{{ if and $last (ne .Role "assistant") }}}}{parts.generation}{{{{ end }}}}{{{{ end }}}}'
    )


def probe_conversations() -> list[list[dict[str, str]]]:
    user, reply = {"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "4."}
    system = {"role": "system", "content": "Answer briefly."}
    again = {"role": "user", "content": "And 3+3?"}
    return [[user], [user, reply, again], [system, user], [system, user, reply, again], [user, reply]]


def verified_template(tokenizer: Any, parts: ChatParts | None) -> str | None:
    """``go_template(parts)`` if it renders every probe conversation as the Jinja template does, else None."""
    if parts is None:
        return None
    strings = [parts.start, parts.generation, parts.default_system or "", *parts.prefix.values()]
    if any("{{" in s or "}}" in s or '"""' in s for s in [*strings, *parts.suffix.values()]):
        return None
    for messages in probe_conversations():
        expected = _render(tokenizer, messages, messages[-1]["role"] != "assistant")
        if render_go(parts, messages) != expected.removeprefix(parts.dropped):
            return None
    return go_template(parts)


def modelfile(gguf_name: str, template: str | None, stops: list[str]) -> str:
    """The Modelfile text: ``FROM ./<gguf_name>``, ``TEMPLATE`` when there is one, a ``PARAMETER stop`` each."""
    lines = [f"FROM ./{gguf_name}"]
    if template is not None:
        lines.append(f'TEMPLATE """{template}"""')
    lines += [f'PARAMETER stop "{stop}"' for stop in stops if '"' not in stop and "\n" not in stop]
    return "\n".join(lines) + "\n"
