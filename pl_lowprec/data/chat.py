"""Chat records rendered by the tokenizer's chat template, with the loss on the assistant's tokens only.

Two record forms, as TRL publishes them: ``messages`` (loss on every assistant turn) and the conversational
prompt/completion (``prompt`` and ``completion`` each a list of turns; loss on the completion). A record's
``tools`` and ``chat_template_kwargs`` (e.g. ``{"enable_thinking": false}``) go to the template, as TRL passes them
(LLaMA-Factory's bare tool schemas wrapped as ``{"type": "function", "function": ...}``: ``wrapped_tool``).
``generate``'s chat prompts go through the same checks (``ChatTemplate.prompt_ids``).

Which tokens are the assistant's is read from the template in one of two ways:
- a template that marks the assistant's text with ``{% generation %}`` is asked for its marks (Hugging Face's
  ``return_assistant_tokens_mask``, what TRL's ``assistant_only_loss`` reads);
- any other template is rendered once per turn: the conversation up to an assistant turn with the generation
  prompt, and up to its end. That is exact only when each rendering of a conversation's start begins the whole
  conversation's rendering. A template that rewrites earlier turns (Qwen3's and DeepSeek-R1's drop their reasoning)
  breaks it, and the loss would land on the wrong tokens, so such a record is refused (``ChatTemplateMismatch``)
  with the fix, before any step. A conversation that starts with an assistant turn has no earlier turns to render
  with the generation prompt: its target starts where the template writes that turn's text (found by rendering the
  turn alone with a stand-in text), so a default system turn and the role's header stay context, as the
  ``{% generation %}`` marks have it.

A token is a target where it starts inside an assistant span or straddles the span's start: after a generation
prompt that ends in a space (``Assistant: ``) the answer's first token (`` return``) begins with that space and
carries the answer's first characters.

A record the template itself refuses (its ``raise_exception``: Gemma's "System role not supported", Mistral's
"roles must alternate") is unusable, as a record without an answer is (``UnusableChatRecord``): the data module
counts it by reason with its line. A record's ``tools`` or ``chat_template_kwargs`` in a form no template can take
is refused naming what is allowed (``TemplateFieldError``); the data module adds the file and line.

A turn's target ends with its end-of-turn token (``</s>``, ``<|im_end|>``, ``<|eot_id|>``): the whitespace a
template writes after it (``</s>\n``) separates turns and is not learned, as axolotl's ``train_on_eos: turn``
and templates' ``{% endgeneration %}`` before the newline have it. A turn the template ends with no such token
trains no token to stop on: refused, or given the tokenizer's EOS, as ``eos_after_turns`` says (``turn_end``). A
role the template does not know, and a turn, tool call, tool or template argument it does not write, make the
record unusable (``chat_roles``, ``template_arguments``).
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from pl_lowprec.data.chat_roles import (
    ANSWER_ROLES,
    unknown_role_reason,
    unwritten_tools_reason,
    unwritten_turn_reason,
)
from pl_lowprec.data.records import Sample
from pl_lowprec.data.template_arguments import template_words, unread_arguments
from pl_lowprec.data.turn_end import ended_marks, ended_spans
from pl_lowprec.models.token_loss import IGNORE_INDEX

GENERATION_MARK = re.compile(r"\{%-?\s*generation\s*-?%\}")  # transformers' own test for the marks
TEMPLATE_FIELDS = ("tools", "chat_template_kwargs")  # read beside any format's fields, under TRL's names
SHOWN_CHARS = 40
TURN_TEXT = "PlLowprecTurnText"  # a stand-in turn text: no whitespace or markup for a template to trim or split
TOOLS_ALLOWED = (
    'A record\'s tools are a list of JSON schemas, one per function ([{"type": "function", "function":'
    ' {"name": ..., "description": ..., "parameters": {...}}}], or LLaMA-Factory\'s bare {"name": ...,'
    ' "description": ..., "parameters": {...}}, wrapped so), or a JSON string of such a list, as TRL passes them'
    " to the chat template; one schema alone, or a JSON string of one, is read as a list of it"
)


class ChatTemplateMismatch(ValueError):
    """The template renders a conversation's start differently on its own than inside the whole conversation."""


class TemplateFieldError(ValueError):
    """A record's ``tools`` or ``chat_template_kwargs`` in a form the template cannot take; the data module names
    the file and line."""


class UnusableChatRecord(Exception):
    """A record whose targets cannot be read with this template (the template refuses it): counted as unusable
    under ``reason``, as a record without an answer is."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


@dataclass(frozen=True)
class ChatTemplate:
    """The tokenizer's template with one record's ``tools`` and ``chat_template_kwargs``."""

    tokenizer: Any
    tools: list[Any] | None = None
    kwargs: dict[str, Any] = field(default_factory=dict)
    eos_after_turns: bool | None = None  # an assistant turn without an end token: refused, or EOS, or kept (turn_end)

    @classmethod
    def for_record(
        cls,
        tokenizer: Any,
        record: dict[str, Any],
        defaults: Mapping[str, Any] | None = None,
        eos_after_turns: bool | None = None,
    ) -> ChatTemplate:
        """The template with the record's ``tools`` and its ``chat_template_kwargs`` over ``defaults`` (the data
        module's or ``generate``'s ``chat_template_kwargs``)."""
        own = record_kwargs(record.get("chat_template_kwargs"))
        return cls(tokenizer, record_tools(record.get("tools")), {**(defaults or {}), **own}, eos_after_turns)

    def render(self, turns: list[dict[str, Any]], generation_prompt: bool = False) -> str:
        return self._apply(turns, tokenize=False, add_generation_prompt=generation_prompt)

    def _apply(self, turns: list[dict[str, Any]], **options: Any) -> Any:
        """``apply_chat_template`` with the record's tools and arguments; the template's own refusal of the record
        (jinja2's ``TemplateError``, from its ``raise_exception``) as ``UnusableChatRecord``."""
        try:
            return self.tokenizer.apply_chat_template(turns, tools=self.tools, **options, **self.kwargs)
        except Exception as error:
            if not raised_by_template(error):
                raise
            raise UnusableChatRecord(refusal_reason(str(error))) from None

    def prompt_ids(self, turns: list[dict[str, Any]]) -> list[int]:
        """The turns and the generation prompt as token ids, without extra special tokens (the template has them),
        checked as training data is (``check_turns``): ``generate`` prompted with a role the template does not
        know, or a turn it drops, answered a conversation other than the one given."""
        rendered = self.check_turns(turns, generation_prompt=True)
        return self.tokenizer(rendered, add_special_tokens=False)["input_ids"]

    def check_turns(self, turns: list[dict[str, Any]], generation_prompt: bool = False) -> str:
        """``turns`` rendered (with the generation prompt, for a prompt), once checked; ``UnusableChatRecord`` for
        turns of a role the template does not know, template arguments it never reads, or turns, tool calls or
        tools that it does not write (``chat_roles``): each would train, or prompt, silently wrong."""
        reason = unknown_role_reason(turns, self.tokenizer.get_chat_template(None, self.tools))
        unread = unread_arguments(self.kwargs, template_words(self.tokenizer))
        if unread and not reason:
            reason = (
                f"records whose chat_template_kwargs name {unread[0]!r}, which the chat template never reads (it"
                " would change nothing): name an argument the template reads, or leave it out"
            )
        if reason:
            raise UnusableChatRecord(reason)
        rendered = self.render(turns, generation_prompt)
        reason = unwritten_turn_reason(turns, rendered) or unwritten_tools_reason(self.tools, rendered)
        if reason:
            raise UnusableChatRecord(reason)
        return rendered

    def has_generation_marks(self) -> bool:
        """Whether the template this record renders with (a tokenizer may hold several by name: ``tool_use`` is
        taken where a record has tools) marks the assistant's text."""
        return bool(GENERATION_MARK.search(self.tokenizer.get_chat_template(None, self.tools)))

    def encode_messages(self, messages: list[dict[str, Any]]) -> Sample:
        """Every assistant turn a target: by the template's ``{% generation %}`` marks where it has them, else by
        the text each turn's prefix renders to."""
        full = self.check_turns(messages)
        if self.has_generation_marks():
            encoded = self._apply(messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
            ids = list(encoded["input_ids"])
            labels = [t if m else IGNORE_INDEX for t, m in zip(ids, encoded["assistant_masks"], strict=True)]
            special = special_token_ids(self.tokenizer)
            return Sample(*ended_marks(ids, labels, self.tokenizer, special, self.eos_after_turns))
        spans = []
        for i, message in enumerate(messages):
            if message.get("role") != "assistant":
                continue
            start = (
                self._prefix_of(full, messages[:i], generation_prompt=True) if i else self._text_start(full, message)
            )
            last = i == len(messages) - 1  # its prefix is the whole conversation: ``full`` itself
            end = len(full) if last else self._prefix_of(full, messages[: i + 1], generation_prompt=False)
            spans.append((start, end))
        return self._encode_spans(full, spans)

    def encode_completion(self, prompt: list[dict[str, Any]], completion: list[dict[str, Any]]) -> Sample:
        """The completion's turns the target: the text after the prompt rendered with the generation prompt, cut
        after each assistant turn so that every one ends at its end-of-turn token (``_completion_pieces``)."""
        turns = prompt + completion
        full = self.check_turns(turns)
        start = self._prefix_of(full, prompt, generation_prompt=True)
        return self._encode_spans(full, self._completion_pieces(full, turns, len(prompt), start))

    def _completion_pieces(
        self, full: str, turns: list[dict[str, Any]], first: int, start: int
    ) -> list[tuple[int, int]]:
        """The completion's span ``[start, len(full))`` cut where each of its assistant turns but the last ends,
        so ``ended_spans`` checks every turn's end, not the last one's alone (a tool call the template ends with
        a newline trained no token to stop on); the tool turns between stay targets, as TRL trains a whole
        completion. Where the template rewrites a turn once later ones follow (Qwen3 writes an empty think block
        in the last assistant turn alone), a turn's end cannot be read from its prefix: the span stays whole."""
        ends = []
        for i in range(first, len(turns) - 1):
            if turns[i].get("role") != "assistant":
                continue
            try:
                ends.append(self._prefix_of(full, turns[: i + 1], generation_prompt=False))
            except ChatTemplateMismatch:
                return [(start, len(full))]
        bounds = [start, *ends, len(full)]
        return list(itertools.pairwise(bounds))

    def _text_start(self, full: str, turn: dict[str, Any]) -> int:
        """Where the template writes the text of ``full``'s first turn, an assistant's: what comes before it (a
        default system turn, the role's header) is context, as ``{% generation %}`` marks have it. Read from
        the turn rendered alone with a stand-in text; a template that does not write that text as given, or writes
        something else before it alone, makes the record unusable."""
        alone = self.render([{**turn, "content": TURN_TEXT}])
        at = alone.find(TURN_TEXT)
        if at < 0 or not full.startswith(alone[:at]):
            raise UnusableChatRecord(
                "records starting with an assistant turn whose text the chat template does not write as given"
                " (rendered alone with a stand-in text, it was not found, or what precedes it differs): put the"
                " user turn it answers before it, or use a template with {% generation %} marks"
            )
        return at

    def _prefix_of(self, full: str, turns: list[dict[str, Any]], generation_prompt: bool) -> int:
        """Where the rendering of ``turns`` ends in ``full``; refused when it is not the start of ``full``."""
        part = self.render(turns, generation_prompt=generation_prompt)
        if full.startswith(part):
            return len(part)
        differs = next((i for i, (a, b) in enumerate(zip(part, full, strict=False)) if a != b), len(full))
        alone = part[max(0, differs - SHOWN_CHARS) : differs + SHOWN_CHARS]
        within = full[max(0, differs - SHOWN_CHARS) : differs + SHOWN_CHARS]
        what = (f"the first {len(turns)} turns" if len(turns) > 1 else "the first turn") + (
            " with the generation prompt" if generation_prompt else ""
        )
        raise ChatTemplateMismatch(
            f"the tokenizer's chat template renders {what} as {alone!r} on their own and as {within!r} at the same"
            f" place in the whole conversation (character {differs}): the template rewrites earlier turns, as"
            " Qwen3's and DeepSeek-R1's drop their reasoning. Which tokens are the assistant's cannot be read from"
            " it, and the loss would fall on the wrong tokens. TextDataModule reads templates whose rendering of a"
            " conversation's start begins the whole conversation's, and templates that mark the assistant's text"
            " with {% generation %}...{% endgeneration %}. Fix: write each assistant turn as its own record,"
            ' {"prompt": [the turns before it], "completion": [the turn]} (TRL\'s conversational prompt/completion),'
            " or give --data.tokenizer a chat template with generation marks (its chat_template.jinja)."
        )

    def _encode_spans(self, full: str, spans: list[tuple[int, int]]) -> Sample:
        """Tokens of ``full``; a token is a target when it starts inside one of the character ``spans``, each
        ended at its end-of-turn token (``ended_spans``), or straddles a span's start (``in_span``)."""
        special = special_token_texts(self.tokenizer)
        full, spans = ended_spans(full, spans, special, self.tokenizer.eos_token, self.eos_after_turns)
        encoded = self.tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
        ids = encoded["input_ids"]
        labels = [
            token if any(in_span(begin, finish, s, e) for s, e in spans) else IGNORE_INDEX
            for token, (begin, finish) in zip(ids, encoded["offset_mapping"], strict=True)
        ]
        return Sample(ids, labels)


def without_doubled_eos(sample: Sample, eos: int) -> tuple[Sample, bool]:
    """``sample`` less the second of two EOS targets side by side, and whether there was one: an answer whose text
    ends with the EOS string the template writes after it too (``"Yo</s>"`` rendered ``Yo</s></s>``) taught the
    model EOS -> EOS, where a completion's own EOS is kept once. An answer that ends with the EOS under a template
    that writes none keeps it: it is the only one."""
    ids, labels = sample.input_ids, sample.labels
    keep = [
        i
        for i in range(len(ids))
        if not (i and ids[i] == ids[i - 1] == eos and IGNORE_INDEX not in (labels[i], labels[i - 1]))
    ]
    if len(keep) == len(ids):
        return sample, False
    return Sample([ids[i] for i in keep], [labels[i] for i in keep]), True


def in_span(begin: int, finish: int, start: int, end: int) -> bool:
    """Whether the token of characters ``[begin, finish)`` is the span ``[start, end)``'s: it starts inside, or
    it straddles the start (the space a generation prompt ends with, and the answer's first characters)."""
    return start <= begin < end or begin < start < min(finish, end)


def raised_by_template(error: BaseException) -> bool:
    """Whether ``error`` is the template's own (jinja2's ``TemplateError``: its ``raise_exception``, an undefined
    value). jinja2 comes with transformers' chat templates; without it no template has run."""
    try:
        from jinja2.exceptions import TemplateError
    except ImportError:
        return False
    return isinstance(error, TemplateError)


def refusal_reason(message: str) -> str:
    """A template's refusal of a record as the reason the record is unusable, with the fix where it is a common
    one (Gemma's templates have no system role; Mistral's and Llama-2's need user and assistant to alternate)."""
    lowered = message.lower()
    if "system" in lowered:
        fix = "the template has no system role: merge the system turn's text into the first user turn"
    elif "alternate" in lowered:
        fix = "start with a user turn and alternate user and assistant, merging consecutive turns of one role"
    else:
        fix = "write these records as it accepts them, or use --data.tokenizer with a template that takes them"
    return f"records the chat template refuses ({message!r}; {fix})"


def record_tools(tools: Any) -> list[Any] | None:
    """A record's ``tools``: a list of JSON schemas, or one JSON string of it (as datasets often store them). One
    schema outside a list (LLaMA-Factory v1's renderer puts any parsed ``tools`` that is not a list in one) is the
    list of it."""
    if tools is None:
        return None
    given = tools
    if isinstance(tools, str):
        try:
            tools = json.loads(tools)
        except json.JSONDecodeError as error:
            raise TemplateFieldError(
                f"'tools' is {shown(given)}, which is not valid JSON ({error.msg} at character {error.pos})."
                f" {TOOLS_ALLOWED}. Fix: write this record's tools as such a list, or leave the field out where a"
                " record has none."
            ) from None
    tools = [tools] if isinstance(tools, dict) else tools
    if isinstance(tools, list) and all(isinstance(tool, dict) for tool in tools):
        return [wrapped_tool(tool) for tool in tools]
    raise TemplateFieldError(
        f"'tools' is {shown(given)}, not a list of JSON schemas. {TOOLS_ALLOWED}. Fix: write them as such a list,"
        " or leave the field out where a record has none."
    )


def wrapped_tool(tool: dict[str, Any]) -> dict[str, Any]:
    """A tool as Hugging Face's chat templates take it: a bare schema (``{"name", "description", "parameters"}``,
    LLaMA-Factory's ``tools`` form) as ``{"type": "function", "function": schema}``, what transformers'
    ``get_json_schema`` gives and LLaMA-Factory's Llama-3/Qwen/Mistral formatters wrap it in. Passed bare, a
    template that writes each tool as JSON (Qwen2.5's, Llama-3.1's ``tool | tojson``) wrote another text than the
    one the model meets at inference, and one that reads ``tool.function.name`` wrote nothing. A tool with a
    ``type`` is left as it is."""
    return tool if "type" in tool or not isinstance(tool.get("name"), str) else {"type": "function", "function": tool}


def record_kwargs(kwargs: Any) -> dict[str, Any]:
    """A record's ``chat_template_kwargs``: an object, or one JSON string of it (a CSV cell); absent values
    (``None``, as a table holds them) left out."""
    if kwargs is None:
        return {}
    given = kwargs
    if isinstance(kwargs, str):
        with contextlib.suppress(json.JSONDecodeError):  # not JSON: refused below, as the text it is
            kwargs = json.loads(kwargs)
    if not isinstance(kwargs, dict):
        raise TemplateFieldError(
            f"'chat_template_kwargs' is {shown(given)}, not an object of the chat template's arguments. A record's"
            ' chat_template_kwargs map argument names to values, as a JSON object ({"enable_thinking": false}) or'
            " a JSON string of one. Fix: write them so in this record, or leave the field out and give every"
            " record the arguments with --data.chat_template_kwargs '{enable_thinking: false}'."
        )
    return {key: value for key, value in kwargs.items() if value is not None}


def shown(value: Any) -> str:
    """A record's value as a message quotes it: its repr (cut short) and its type."""
    text = repr(value)
    text = text if len(text) <= 2 * SHOWN_CHARS else text[: 2 * SHOWN_CHARS] + "..."
    return f"{text} (a {type(value).__name__})"


@functools.lru_cache(maxsize=8)  # once per tokenizer, not per turn: added_tokens_decoder builds a dict each call
def special_token_texts(tokenizer: Any) -> frozenset[str]:
    """The texts of a tokenizer's special tokens: its named ones and the added tokens marked special."""
    added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    named = getattr(tokenizer, "all_special_tokens", [])
    return frozenset(named) | {t.content for t in added.values() if t.special}


@functools.lru_cache(maxsize=8)
def special_token_ids(tokenizer: Any) -> frozenset[int]:
    """The ids of ``special_token_texts``."""
    return frozenset(tokenizer.convert_tokens_to_ids(sorted(special_token_texts(tokenizer))))


def turns_problem(turns: Any) -> str | None:
    """Why ``turns`` is not a list of chat turns (``{role, content}``; an assistant's tool call may have
    ``tool_calls`` and no content), or ``None``."""
    if not isinstance(turns, list) or not turns:
        return "not a non-empty list of turns"
    for turn in turns:
        if not isinstance(turn, dict) or not isinstance(turn.get("role"), str):
            return "a turn without a string 'role'"
        if is_content_parts(turn.get("content")):
            return (
                "a turn whose 'content' is a list of parts ([{'type': 'text', 'text': ...}], OpenAI's and the vision"
                " models' form), which a text model's chat template writes as the list's Python text: join the"
                " parts' text into one string"
            )
        if not isinstance(turn.get("content"), str) and not turn.get("tool_calls"):
            return "a turn without a string 'content' (or an assistant's 'tool_calls')"
    return None


def is_content_parts(content: Any) -> bool:
    """Whether a turn's ``content`` is a list of typed parts (``{"type": "text", "text": ...}``)."""
    return isinstance(content, list) and bool(content) and all(isinstance(p, dict) and "type" in p for p in content)


def empty_answer_reason(turns: list[dict[str, Any]], eos_token: str | None = None) -> str | None:
    """Why a record whose answer turns (``assistant``) include an empty one (blank, or the ``eos_token`` alone) is
    unusable, or ``None``. An empty answer trains the model to end its turn at once (only the end-of-turn token is
    a target), where an empty string completion is refused; an answer with only ``tool_calls`` (or a reasoning
    field) is not empty."""
    for turn in turns:
        if turn.get("role") != "assistant":
            continue
        others = [value for key, value in turn.items() if key not in ("role", "content") and value]
        content = turn.get("content")
        if not others and (content is None or (isinstance(content, str) and content.strip() in ("", eos_token))):
            return (
                "records with an empty assistant turn (it would train the model to end its answer at once): drop"
                " them or write their answers"
            )
    return None


def no_answer_reason(turns: list[dict[str, Any]]) -> str | None:
    """Why a ``messages`` record has nothing to train on when no turn has the role ``assistant`` (the roles it
    has, and the rename where one of them names the answers), or ``None``."""
    roles = list(dict.fromkeys(turn["role"] for turn in turns))
    if "assistant" in roles:
        return None
    reason = f"records with no turn of role 'assistant' (roles seen: {', '.join(roles)})"
    named = [role for role in roles if role.lower() in ANSWER_ROLES]
    if named:
        reason += f": rename the answers' role {named[0]!r} to 'assistant'"
    return reason
