"""Records of a fine-tuning file turned into token ids and labels, with every unusable record counted.

Formats, by the fields of each record (a ``.jsonl`` line, a row of a dataset; a ``.txt`` file is one ``text``
record; ``pl_lowprec.data.fields`` maps other column names to these):
- ``text``: language modelling on every token; records are joined (each ends with EOS) and cut into blocks
  (``pl_lowprec.data.text_blocks``).
- ``prompt`` + ``completion``: loss on the completion (and its EOS) only; the two are tokenized as one text.
- ``messages``, or ``prompt`` + ``completion`` as lists of turns: a chat rendered with the tokenizer's chat
  template; loss on the assistant turns, or on the completion's (``pl_lowprec.data.chat``).
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pl_lowprec.data.special_tokens import Tokens, tokens_once
from pl_lowprec.models.token_loss import IGNORE_INDEX

SHOWN_CHARS = 20  # of a prompt's end, in the report of a prompt that ends inside a token


@dataclass
class Sample:
    input_ids: list[int]
    labels: list[int]


@dataclass
class FileReport:
    """What one file (or dataset) gave: usable records, and unusable ones by reason with their first line numbers
    (``unit``: a dataset's records are numbered by row index, from 0 as ``dataset[i]``)."""

    path: Path | str
    unit: str = "lines"
    used: int = 0
    bad: Counter = field(default_factory=Counter)
    first_lines: dict[str, list[int]] = field(default_factory=dict)
    truncated: int = 0
    target_tokens: int = 0
    lost_target_tokens: int = 0
    target_positions: Counter = field(default_factory=Counter)
    columns: set[str] = field(default_factory=set)  # every field name a record had, before any mapping
    notes: Counter = field(default_factory=Counter)  # facts of records said once per file, not per record
    inside_token: int = 0  # prompts that end inside a token of prompt + completion
    inside_token_example: str = ""  # the first of them

    def count_targets(self, labels: list[int], seq_len: int) -> None:
        """Tally a sample's target tokens (the first label is never predicted) and those past ``seq_len``."""
        positions = [i for i, label in enumerate(labels) if i > 0 and label != IGNORE_INDEX]
        lost = sum(1 for i in positions if i >= seq_len)
        self.target_positions.update(positions)
        self.target_tokens += len(positions)
        self.lost_target_tokens += lost
        self.truncated += len(labels) > seq_len

    def lost_share(self) -> float:
        return self.lost_target_tokens / self.target_tokens if self.target_tokens else 0.0

    def seq_len_keeping(self, share: float) -> int:
        """The shortest ``seq_len`` (a multiple of 8) that keeps ``share`` of this file's target tokens."""
        kept = 0
        for position in sorted(self.target_positions):
            kept += self.target_positions[position]
            if kept >= share * self.target_tokens:
                return -(-(position + 1) // 8) * 8
        return 8

    def reject(self, reason: str, line: int) -> None:
        self.bad[reason] += 1
        self.first_lines.setdefault(reason, [])
        if len(self.first_lines[reason]) < 5:
            self.first_lines[reason].append(line)

    def note(self, fact: str) -> None:
        self.notes[fact] += 1

    def prompt_ends_inside(self, prompt: str, token: str) -> None:
        self.inside_token += 1
        if not self.inside_token_example:
            self.inside_token_example = f"{prompt[-SHOWN_CHARS:]!r} ends inside the token {token!r}"

    def describe_notes(self) -> str | None:
        """The file's notes in one line, or ``None``."""
        said = "; ".join(f"{n} {_singular(fact) if n == 1 else fact}" for fact, n in self.notes.items())
        return f"{self.path}: {said}." if said else None

    def describe_inside_token(self) -> str | None:
        """What prompts that end inside a token train, and the fix, or ``None``."""
        if not self.inside_token:
            return None
        records = "1 record's prompt ends" if self.inside_token == 1 else f"{self.inside_token} records' prompts end"
        return (
            f"{self.path}: {records} inside a token of prompt + completion (the first: {self.inside_token_example})."
            " That token is trained as the completion's first, so the model learns to answer a prompt short of its"
            " end, and generation gives it the whole prompt, tokenized otherwise. The usual cause is a prompt that"
            " ends in a space (most tokenizers put a space in the next word's token): end the prompt before the"
            " space and start the completion with it."
        )

    def describe(self) -> str:
        reasons = "; ".join(
            f"{n} {_singular(reason) if n == 1 else reason} ({self.unit} {self.first_lines[reason]})"
            for reason, n in self.bad.items()
        )
        truncation = (
            f"; {self.truncated} truncated, losing {self.lost_target_tokens} of {self.target_tokens} target tokens"
            f" ({self.lost_share():.1%})"
            if self.target_tokens
            else ""
        )
        return (
            f"{self.path}: {self.used} record{'' if self.used == 1 else 's'} used, {sum(self.bad.values())} skipped"
            + (f": {reasons}" if reasons else "")
            + truncation
        )


def _singular(reason: str) -> str:
    """``records with an empty completion`` of one record: ``record with an empty completion``."""
    return "record" + reason.removeprefix("records") if reason.startswith("records ") else reason


def read_records(path: Path, report: FileReport) -> Iterator[tuple[int, dict[str, Any]]]:
    """(line number, record) for each record of a ``.txt`` or ``.jsonl`` file; bad JSON is counted. A leading
    UTF-8 byte order mark (Windows editors and Excel write one) is not part of the text."""
    if path.suffix == ".txt":
        yield 1, {"text": decoded(path, path.read_bytes(), 1).removeprefix(BYTE_ORDER_MARK)}
        return
    with path.open("rb") as handle:
        for number, raw in enumerate(handle, start=1):
            line = decoded(path, raw, number)
            if number == 1:
                line = line.removeprefix(BYTE_ORDER_MARK)
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                report.reject("invalid JSON", number)
                continue
            if not isinstance(record, dict):
                report.reject("not a JSON object", number)
                continue
            yield number, record


BYTE_ORDER_MARK = "\ufeff"


def decoded(path: Path, raw: bytes, first_line: int) -> str:
    """``raw`` as UTF-8, or a refusal naming the file, the line and the byte: a replacement character in place of
    each bad byte would train on text the file does not hold."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as err:
        line = first_line + raw.count(b"\n", 0, err.start)
        column = err.start - (raw.rfind(b"\n", 0, err.start) + 1)
        raise ValueError(
            f"{path}, line {line}: byte {raw[err.start]:#04x} at column {column + 1} is not UTF-8 ({err.reason}),"
            " and the data files are read as UTF-8. Re-save the file as UTF-8, e.g. iconv -f latin1 -t utf-8"
            f" {path} > {path.with_name(path.stem + '.utf8' + path.suffix)} (latin1 standing for its encoding)."
        ) from None


def encode_text(tokenizer: Any, text: str, report: FileReport | None = None) -> list[int]:
    """The text's tokens with its BOS and EOS once each (``pl_lowprec.data.special_tokens``): EOS is appended
    where neither the text nor the tokenizer ends it with one; a text that carries its own is noted in ``report``.
    It is cut into blocks with the records around it (``text_blocks``), which keep where it starts."""
    tokens = tokens_once(tokenizer, text)
    _note_carried(report, tokenizer, tokens, "text", "text")
    return _with_eos(tokens.ids, tokenizer.eos_token_id)


def encode_prompt_completion(tokenizer: Any, prompt: str, completion: str, report: FileReport | None = None) -> Sample:
    """``prompt + completion`` tokenized as one text, as the model reads it when it generates and as TRL's
    ``SFTTrainer`` tokenizes it; loss on the tokens that end after the prompt's last character, and on the EOS.

    Tokenized on its own, the completion would start as a text starts: a SentencePiece tokenizer (Metaspace, as
    Mistral's and Llama-2's) puts a space before it (``'A:'`` + ``'4'`` trained ``'A: 4'``), and a tokenizer that
    appends EOS put one after the prompt. A token that holds the prompt's end and the completion's start (a prompt
    that ends in a space, with the word after it) is a target: the ids stay those of the whole text, and such
    records are counted in ``report`` (said once per file, where TRL warns per record)."""
    text = prompt + completion
    tokens = tokens_once(tokenizer, text, offsets=True)
    first = _first_ending_after(tokens.added, tokens.offsets, len(prompt))
    if report is not None and first < len(tokens.ids) and tokens.offsets[first][0] < len(prompt):
        start, end = tokens.offsets[first]
        report.prompt_ends_inside(prompt, text[start:end])
    _note_carried(report, tokenizer, tokens, "prompt", "completion")
    ids = _with_eos(tokens.ids, tokenizer.eos_token_id)
    return Sample(ids, [IGNORE_INDEX] * first + ids[first:])


def _first_ending_after(added: list[bool], offsets: list[tuple[int, int]], chars: int) -> int:
    """The first token of the text's own (not one the tokenizer added) that ends after its first ``chars``
    characters (``len(offsets)``: none). Its end, not its start: a byte-level tokenizer may trim a token's leading
    space from its offsets."""
    spans = enumerate(zip(added, offsets, strict=True))
    return next((i for i, (extra, (_, end)) in spans if not extra and end > chars), len(offsets))


def _with_eos(ids: list[int], eos: int) -> list[int]:
    """``ids`` ending with one EOS: appended only where they do not end with it already (TRL's ``add_eos``)."""
    return ids if ids and ids[-1] == eos else [*ids, eos]


def _note_carried(report: FileReport | None, tokenizer: Any, tokens: Tokens, start: str, end: str) -> None:
    """Note that the text's ``start`` field began with the BOS the tokenizer adds too, and that its ``end`` field
    ended with the EOS: each kept once."""
    if report is None:
        return
    if tokens.bos_kept_once:
        report.note(f"records whose {start} begins with the BOS {tokenizer.bos_token!r}, not added a second time")
    if tokens.written_last(tokenizer.eos_token_id):
        report.note(f"records whose {end} ends with the EOS {tokenizer.eos_token!r}, not appended a second time")
    if tokens.space_after_eos_dropped:
        report.note(f"records whose {end} has whitespace after its final EOS, not trained (not content)")


def record_kind(record: dict[str, Any]) -> str | None:
    if "messages" in record:
        return "messages"
    if "prompt" in record or "completion" in record:
        return "prompt_completion"
    if "text" in record:
        return "text"
    return None
