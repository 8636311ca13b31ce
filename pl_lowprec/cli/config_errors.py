"""Configuration errors as one paragraph: what was wrong, what is allowed, how to fix it.

jsonargparse reports a bad value inside a ``Union`` (every strategy, plugin and callback of the Trainer) as a
60-100 line dump of each subtype it tried, with the class's own message buried in it, and its usage line lists
every option. ``LowPrecisionCLI`` uses three pieces from here instead:

- ``ClassRefusals`` is an instantiator (jsonargparse's hook for building classes): it remembers the first error
  that a class's ``__init__`` raised, so that the CLI prints that message and not jsonargparse's wrapping of it;
- ``parse_error_paragraph`` turns a parsing error into one paragraph: the option, the value, and for ``Literal``
  options the allowed values and the closest one;
- ``refuse`` prints the paragraph and exits with status 2, argparse's status for bad arguments; ``refusals`` does
  so for a refusal raised inside it (every subcommand of its own runs inside one: ``dispatch.py``).

``JSONARGPARSE_DEBUG=true`` (jsonargparse's own switch) or ``PL_LOWPREC_DEBUG=1`` shows the original error and
its traceback instead.
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, NoReturn

from lightning.pytorch.strategies import StrategyRegistry
from lightning.pytorch.utilities.rank_zero import rank_zero_only

from pl_lowprec._checks import CannotRunHere
from pl_lowprec._did_you_mean import closest, did_you_mean
from pl_lowprec._error_text import raised_in, raised_under
from pl_lowprec.plugins.amp import MIXED_SPELLINGS
from pl_lowprec.strategy_names import STRATEGY_NAMES

# Errors by which a class or a check refuses a value; anything else (a bug) keeps its traceback.
REFUSALS: tuple[type[BaseException], ...] = (ValueError, TypeError, ImportError, FileNotFoundError, CannotRunHere)
EXIT_STATUS = 2
DEBUG_HINT = "PL_LOWPREC_DEBUG=1 shows the traceback"


class ConfigurationError(SystemExit):
    """Raised by ``refuse``: ``SystemExit`` with status 2, the paragraph already printed."""

    def __init__(self, message: str) -> None:
        super().__init__(EXIT_STATUS)
        self.message = message


def debugging() -> bool:
    """jsonargparse's debug switch (it accepts ``true`` and ``false`` only), or the package's own."""
    jsonargparse = os.environ.get("JSONARGPARSE_DEBUG", "").lower() == "true"
    return jsonargparse or os.environ.get("PL_LOWPREC_DEBUG", "").lower() in ("1", "true")


def refuse(message: str, prog: str | None = None) -> NoReturn:
    """Print ``error: <message>`` (``<prog>: error: ...``, as argparse words it) to stderr and exit with status 2.
    A rank other than 0 of a multi-process run says which it is (``[rank: 1] error: ...``), as Lightning's
    messages do: every rank that refuses prints its paragraph."""
    rank = getattr(rank_zero_only, "rank", 0)
    where = f"[rank: {rank}] " if rank else ""
    sys.stderr.write(f"{where}{prog + ': ' if prog else ''}error: {message.strip()}\n")
    sys.stderr.flush()
    raise ConfigurationError(message)


@contextmanager
def refusals(prog: str | None = None) -> Iterator[None]:
    """A refusal raised inside reaches the user as one paragraph and exit status 2, without a traceback (unless
    ``debugging()``). A message that is not the package's own (a library's: perhaps a bug) says how to see the
    traceback."""
    try:
        yield
    except REFUSALS as err:
        if debugging():
            raise
        refuse(refusal_message(err), prog)


def refusal_message(err: BaseException) -> str:
    """``err``'s first paragraph; one that is not the package's own (a library's: perhaps a bug) says how to see the
    traceback."""
    message = first_paragraph(str(err)) or type(err).__name__
    return message if raised_by_package(err) else f"{message} ({DEBUG_HINT})"


def raised_by_package(err: BaseException) -> bool:
    """Whether ``err`` was raised in pl_lowprec's own code (a refusal it words itself)."""
    return raised_under(err, "pl_lowprec")


@dataclass
class Refusal:
    class_name: str | None
    error: BaseException

    def paragraph(self, key: str | None) -> str:
        """``key (Class): message``, leaving out what the message already says."""
        message = first_paragraph(str(self.error))
        named = self.class_name is None or message.startswith(self.class_name)
        where = key if named else f"{key} ({self.class_name})" if key else self.class_name
        return f"{where}: {message}" if where else message


@dataclass
class ClassRefusals:
    """An instantiator for every class the CLI builds that records the first refusal of a class's ``__init__``."""

    refusals: list[Refusal] = field(default_factory=list)

    def __call__(self, class_type: type, *args: Any, **kwargs: Any) -> Any:
        try:
            return class_type(*args, **kwargs)
        except REFUSALS as err:
            self.refusals.append(Refusal(class_type.__name__, err))
            raise

    def last(self) -> Refusal | None:
        """The latest refusal: an inner class (a ``QuantizationConfig``) refuses before the one holding it."""
        return self.refusals[-1] if self.refusals else None


def class_key(config: Any, class_name: str) -> str | None:
    """The config key (``trainer.strategy``) whose ``class_path`` names ``class_name``; ``None`` if none does."""
    found: list[str] = []

    def walk(node: Any, key: str) -> None:
        if isinstance(node, dict):
            path = node.get("class_path")
            if isinstance(path, str) and path.rpartition(".")[2] == class_name:
                found.append(key)
            for name, value in node.items():
                walk(value, f"{key}.{name}" if key else str(name))
        elif isinstance(node, list):
            for index, value in enumerate(node):
                walk(value, f"{key}[{index}]" if len(node) > 1 else key)

    walk(config, "")
    return found[-1] if found else None


def raised_refusal(err: BaseException, kinds: tuple[type[BaseException], ...] = REFUSALS) -> Refusal | None:
    """The refusal in ``err`` or its causes that a class's ``__init__`` raised, not jsonargparse.

    jsonargparse passes on the error of a class it builds outside a ``Union`` as it is, and inside one as the
    cause of its dump when the class was the first subtype tried (``model``, ``data``)."""
    seen: BaseException | None = err
    while seen is not None:
        if isinstance(seen, kinds) and own_error(seen):
            return Refusal(_refusing_class(seen), seen)
        seen = seen.__cause__
    return None


def _refusing_class(err: BaseException) -> str | None:
    """The class whose ``__init__`` is the outermost one in the traceback of ``err``."""
    tb = err.__traceback__
    while tb is not None:
        frame = tb.tb_frame
        if frame.f_code.co_name == "__init__" and "self" in frame.f_locals:
            return type(frame.f_locals["self"]).__name__
        tb = tb.tb_next
    return None


def own_error(err: BaseException) -> bool:
    """Whether ``err`` was raised outside jsonargparse, i.e. by the class it was building (not a wrapping)."""
    where = raised_in(err)
    return where is not None and f"{os.sep}jsonargparse{os.sep}" not in where


_STRATEGY_NAME = re.compile(r"invalid strategy name: `strategy='(?P<name>[^']*)'`")


def with_strategy_names(message: str) -> str:
    """Lightning's refusal of an unknown ``strategy=`` name lists a few of its own names only; add the closest
    registered name and pl_lowprec's names (``import pl_lowprec`` registered them)."""
    given = _STRATEGY_NAME.search(message)
    if given is None:
        return message
    hint = did_you_mean(closest(given.group("name"), StrategyRegistry.available_strategies(), cutoff=0.6))
    return f"{message.rstrip('.')}.{hint} pl_lowprec's names: {', '.join(STRATEGY_NAMES)}."


def first_paragraph(text: str) -> str:
    """The message up to its first blank line, on one line."""
    return " ".join(text.strip().split("\n\n")[0].split())


# ---- parsing errors ----

_KEY = re.compile(r'^(?P<indent>\s*)(?:- )?Parser key "(?P<key>[^"]+)"')
_CLASS_PATH = re.compile(r"^(?P<indent>\s*)(?:- )?Problem with given class_path '(?P<path>[^']+)'")
_LITERAL = re.compile(r"typing\.Literal\[(?P<values>[^\]]*)\]")
_GIVEN = re.compile(r"^\s*(?:Given value|Got value): (?P<value>.*)$|\. Got value: (?P<inline>.*)$")
_CLASS = re.compile(r"(?:\ban? )?<class '(?:[\w.]+\.)?(?P<name>\w+)'>")
_NOISE = re.compile(
    r"Does not validate against any of the Union subtypes|^\s*(?:Subtypes|Errors|Given value type|Given value):"
    r"|Expected a <class '(?:NoneType|str)'>|^\s*- (?:a class path|a dict with|a dict without)|Subclass types expect"
    r"|Expected a path but .* either not accessible|Expected a dot import path string|NestedArg\(|does not correspond"
    r"|is abstract$|^\s*$"
)


def parse_error_paragraph(message: str) -> str:
    """One paragraph for a jsonargparse parsing error: the full option name, the value, what is allowed."""
    lines = message.splitlines()
    key, section = _innermost_option(lines)
    value = _given_value(section)
    literals = _literal_values(section)
    if literals and value is not None and value not in literals:
        return _literal_paragraph(key, value, literals, _other_types(section))
    reasons = [_clean(line) for line in section if not _NOISE.search(line) and not _KEY.match(line)]
    reasons = [r for r in dict.fromkeys(reasons) if r]
    if not reasons:
        return first_paragraph(message)
    expected = [r.removeprefix("Expected ") for r in reasons if r.startswith("Expected ")]
    if value is not None and key and expected and len(expected) == len(reasons):  # a Union of plain types
        return f"{key}={value!r} is not allowed: it takes {' or '.join(_article(e) for e in expected)}."
    reason = "; ".join(reasons[:3])
    return f"{key}: {reason}" if key else reason


def _article(type_name: str) -> str:
    return f"an {type_name}" if type_name[:1] in "aeiou" else f"a {type_name}"


def _innermost_option(lines: list[str]) -> tuple[str | None, list[str]]:
    """The dotted option of the most deeply nested ``Parser key`` (``trainer.strategy.init_args.quantization``)
    and the lines of its error; the whole message when it names no key."""
    parts: list[tuple[int, str]] = []
    best: tuple[int, str, int] | None = None  # indent, option, line number
    for number, line in enumerate(lines):
        match = _KEY.match(line) or _CLASS_PATH.match(line)
        if match is None:
            continue
        indent = len(match.group("indent"))
        parts = [(i, p) for i, p in parts if i < indent]
        parts.append((indent, match.group("key") if "key" in match.groupdict() else "init_args"))
        if _KEY.match(line) and (best is None or indent > best[0]):
            best = (indent, ".".join(p for _, p in parts), number)
    if best is None:
        return None, lines
    indent, option, number = best
    section = [lines[number]]
    for line in lines[number + 1 :]:
        if line.strip() and len(line) - len(line.lstrip()) <= indent:
            break
        section.append(line)
    return option, section


def _given_value(lines: list[str]) -> str | None:
    for line in lines:
        match = _GIVEN.search(line)
        if match:
            value = (match.group("value") or match.group("inline") or "").strip()
            if not value.startswith(("NestedArg(", "Namespace(", "[Namespace(")):
                return value
    return None


def _literal_values(lines: list[str]) -> list[str]:
    values: list[str] = []
    for line in lines:
        for match in _LITERAL.finditer(line):
            for item in match.group("values").split(","):
                item = item.strip().strip("'\"")
                if item and item not in values:
                    values.append(item)
    return values


def _other_types(lines: list[str]) -> list[str]:
    """The non-``Literal`` alternatives named in the ``Subtypes`` line (``QuantizationConfig``, ``null``)."""
    subtypes = next((line for line in lines if line.strip().startswith("Subtypes:")), "")
    names = [m.group("name") for m in _CLASS.finditer(_LITERAL.sub("", subtypes))]
    return ["null" if n == "NoneType" else f"a {n}" for n in dict.fromkeys(names) if n not in ("str", "int")]


PLUGIN_AUTO = (
    " For the device's own choice (bf16-mixed where it computes bf16 natively, fp16 with loss scaling on GPUs"
    " without it, fp32 on other CPUs), leave trainer.precision unset and give the plugin's: trainer.plugins:"
    " [{class_path: pl_lowprec.AMPPrecision, init_args: {precision: auto}}]."
)


def _literal_paragraph(key: str | None, value: str, allowed: list[str], others: list[str]) -> str:
    shown = ", ".join(repr(a) for a in allowed) + "".join(f", {o}" for o in others)
    hint = did_you_mean(closest_allowed(value, allowed))
    if key is not None and key.endswith("trainer.precision") and value.lower() == "auto":
        hint = PLUGIN_AUTO
    option = key or "the value"
    return f"{option}={value!r} is not allowed. Allowed: {shown}.{hint}"


def closest_allowed(value: str, allowed: list[str]) -> str | None:
    """The allowed value meant: the same in another case ('AUTO'), another spelling of a precision ('fp16' for
    '16-mixed', as the plugin's own refusal suggests), else the nearest by spelling."""
    return closest(value, allowed, cutoff=0.5, spellings=MIXED_SPELLINGS, ignore_case=True)


def _clean(line: str) -> str:
    text = _CLASS.sub(lambda match: match.group("name"), line.strip().removeprefix("- ").strip())
    return text.rstrip(".:")
