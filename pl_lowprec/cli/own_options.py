"""A mistyped option, named with the one meant.

``export``, ``generate``, ``estimate`` and ``plan`` pass what they do not know to LightningCLI as config overrides
(``--model.pretrained DIR``). A mistyped option of their own (``--max-new-tokens`` for ``--max_new_tokens``)
would reach it too, and come back as jsonargparse's "unrecognized arguments" with ``pl-lowprec --help``; here it
is one line naming the option meant (``check_own_options``). A mistyped config key (``--trainer.max-steps``,
``--model.pretrainedd``) gets the key meant added to jsonargparse's refusal (``meant_config_key``).
"""

from __future__ import annotations

import argparse
import importlib
import re
from typing import NamedTuple

from lightning.pytorch import Trainer

from pl_lowprec._did_you_mean import closest
from pl_lowprec.cli.arguments import options
from pl_lowprec.strategies.signature import keyword_arguments

CLOSE = 0.8  # difflib's ratio: --max_new_token, --gguf-type, --overwrit; not --optimizer for --overwrite
OTHER_TOOLS_NAMES = {"--lora_model_dir": "--pretrained_adapter"}  # axolotl's name for continuing a saved adapter


def own_option_names(parser: argparse.ArgumentParser) -> list[str]:
    return [name for action in parser._actions for name in action.option_strings if name.startswith("--")]


def meant_option(name: str, own: list[str]) -> str | None:
    """The subcommand's option that ``name`` mistypes: the same with underscores, else the one closest; ``None``
    for a config key (``--data.seq_len``: dotted) or nothing close."""
    if "." in name or name in own:
        return None
    underscored = "--" + name[2:].replace("-", "_")
    if underscored in own:
        return underscored
    return closest(name, own, cutoff=CLOSE, spellings=OTHER_TOOLS_NAMES)


def check_own_options(parser: argparse.ArgumentParser, unknown: list[str], takes_overrides: bool = True) -> None:
    """``ValueError`` for the first of ``unknown`` (what ``parse_known_args`` left) that mistypes one of
    ``parser``'s options; with ``takes_overrides=False`` (``--model``: no config is read) for any of them, saying
    where config overrides go."""
    own = own_option_names(parser)
    for option in options(unknown):
        meant = meant_option(option.name, own) if option.name else None
        if meant is not None:
            raise ValueError(
                f"{option.name} is not an option of {parser.prog}: did you mean {meant}? Its options are spelled"
                f" with underscores (`{parser.prog} --help` lists them)."
            )
    if unknown and not takes_overrides:
        raise ValueError(
            f"{parser.prog} does not know {' '.join(unknown)}: config overrides (--model.*, --data.*, --trainer.*)"
            f" go with --ckpt_path, which rebuilds the run from its config; `{parser.prog} --help` lists the"
            " options."
        )


_UNRECOGNIZED = re.compile(r"unrecognized arguments: --(?P<key>[\w.-]+)")
_NOT_ACCEPTED_HERE = re.compile(r"(?:Group '(?P<group>[\w.]+)' )?does not accept option '(?P<key>[\w.-]+)'")
_CLASS_OPTION = re.compile(r"class_path '(?P<path>[\w.]+)'[:;]\s+Option '(?P<key>[\w.-]+)' is not accepted")
_PARSER_KEY = re.compile(r'Parser key "(?P<section>[\w.]+)"')


class RefusedKey(NamedTuple):
    """A key jsonargparse refused: its section (``trainer``, ``model.init_args``, empty for the top level), the key,
    the class whose option it is not (empty where the section is no class's), and whether it came as
    ``--section.key`` on the command line rather than in a config."""

    section: str
    key: str
    class_path: str
    on_command_line: bool = False


def refused_key(message: str) -> RefusedKey | None:
    """The key jsonargparse refused, from its message; ``None`` where it refused no key. The one reader of these
    messages: ``meant_config_key`` suggests the key meant, ``misplaced_keys`` the section that takes it."""
    found = _CLASS_OPTION.search(message)
    if found is not None:  # the class's section: the last key named before it
        sections = _PARSER_KEY.findall(message[: found.start()])
        return RefusedKey(sections[-1] if sections else "", found["key"], found["path"])
    found = _UNRECOGNIZED.search(message)
    if found is not None:
        section, _, key = found["key"].rpartition(".")
        return RefusedKey(section, key, "", on_command_line=True)
    found = _NOT_ACCEPTED_HERE.search(message)  # "Group 'trainer' does not accept option 'x'", or 'trainer.x'
    if found is None:
        return None
    section, _, key = ".".join(filter(None, (found["group"], found["key"]))).rpartition(".")
    return RefusedKey(section, key, "")


def meant_config_key(message: str) -> str | None:
    """For jsonargparse's refusal of an unknown key, the key meant: ``--trainer.max_steps`` for
    ``--trainer.max-steps``, ``pretrained`` for the class option ``pretrainedd``; ``None`` for anything else."""
    refused = refused_key(message)
    if refused is None or "." in refused.key:
        return None
    if refused.on_command_line and refused.section == "trainer":
        meant = meant_option(f"--{refused.key}", [f"--{name}" for name in keyword_arguments(Trainer)])
        return f"--trainer.{meant[2:]}" if meant else None
    if not refused.class_path:
        return None
    module, _, name = refused.class_path.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError):
        return None
    meant = meant_option(f"--{refused.key}", [f"--{argument}" for argument in keyword_arguments(cls)])
    return meant[2:] if meant else None
