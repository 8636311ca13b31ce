"""A subcommand's own option, mistyped, named before it reaches the config parser.

``export``, ``generate``, ``estimate`` and ``plan`` pass what they do not know to LightningCLI as config overrides
(``--model.pretrained DIR``). A mistyped option of their own (``--max-new-tokens`` for ``--max_new_tokens``)
would reach it too, and come back as jsonargparse's "unrecognized arguments" with ``pl-lowprec --help``; here it
is one line naming the option meant.
"""

from __future__ import annotations

import argparse
import difflib

from pl_lowprec.cli.arguments import options

CLOSE = 0.8  # difflib's ratio: --max_new_token, --gguf-type, --overwrit; not --optimizer for --overwrite


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
    close = difflib.get_close_matches(name, own, n=1, cutoff=CLOSE)
    return close[0] if close else None


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
