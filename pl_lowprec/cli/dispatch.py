"""The ``pl-lowprec`` console script: each subcommand of its own to its ``main``, the rest to LightningCLI."""

from __future__ import annotations

import sys
from collections.abc import Callable

from pl_lowprec.cli import estimate, export, generate, make_demo_model, plan
from pl_lowprec.cli.arguments import config_paragraph, configs_read_once
from pl_lowprec.cli.config_errors import refusals
from pl_lowprec.cli.exit_without_collection import skip_collection_at_exit
from pl_lowprec.cli.lightning_cli import build_cli
from pl_lowprec.cli.subcommands import LIGHTNING_SUBCOMMANDS, unknown_subcommand_paragraph
from pl_lowprec.cli.version import version_text
from pl_lowprec.transforms.pretrained_adapter import adapters_resolved_once

SUBCOMMANDS: dict[str, Callable[[list[str]], None]] = {
    "export": export.main,
    "generate": generate.main,
    "estimate": estimate.main,
    "plan": plan.main,
    "make-demo-model": make_demo_model.main,
}


@adapters_resolved_once()  # the strategy LightningCLI builds, and plan's candidates: the adapter resolved once
@configs_read_once()  # the checks parse each --config; the later readers take that parse
def main(args: list[str] | None = None) -> None:
    """The ``pl-lowprec`` console script; ``args`` replaces ``sys.argv[1:]``.

    Subcommands: ``fit``, ``validate``, ``test``, ``predict`` (LightningCLI), ``estimate`` (memory estimate),
    ``plan`` (the memory settings that fit a budget), ``make-demo-model`` (a small pretrained model and a
    fine-tuning task, made locally), ``export`` (a checkpoint to a peft adapter directory or a merged model) and
    ``generate`` (completions of a file of prompts). A refusal of any of them is one paragraph and exit status 2
    (``config_errors.refusals``). ``pl-lowprec --version`` prints the versions (``version.version_text``).
    """
    skip_collection_at_exit()  # the interpreter's teardown walks no objects once the command is done
    argv = sys.argv[1:] if args is None else args
    if argv[:1] == ["--version"]:
        print(version_text())
        return
    known = bool(argv) and (argv[0] in SUBCOMMANDS or argv[0] in LIGHTNING_SUBCOMMANDS or argv[0].startswith("-"))
    if not known:  # before its arguments: a misspelt subcommand is the first thing to fix
        with refusals("pl-lowprec"):
            raise ValueError(unknown_subcommand_paragraph(argv[0] if argv else None))
    config = argv[1:]
    unread = config_paragraph(config)
    if unread is not None:
        with refusals(f"pl-lowprec {argv[0]}"):
            raise ValueError(unread)
    subcommand = SUBCOMMANDS.get(argv[0])
    if subcommand is not None:
        with refusals(f"pl-lowprec {argv[0]}"):
            subcommand(argv[1:])
        return
    build_cli(args)
