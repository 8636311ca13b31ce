"""The ``pl-lowprec`` subcommands, each in one line: the top-level help lists them all (LightningCLI's listed its own
four: the package's are added to its parser, ``lightning_cli.LowPrecisionCLI._add_subcommands``), and an unknown or
missing subcommand is refused with the list and the nearest name."""

from __future__ import annotations

import argparse
from collections.abc import Iterable
from typing import Any

from pl_lowprec._did_you_mean import closest
from pl_lowprec.strategy_names import STRATEGY_NAMES

LIGHTNING_SUBCOMMANDS = {
    "fit": "train from a config",
    "validate": "the validation loss of a checkpoint",
    "test": "a test loop, where the module and data have one",
    "predict": "a predict loop, where the module and data have one",
}
OWN_SUBCOMMANDS = {
    "estimate": "the peak memory and step time of a config, predicted before it runs",
    "plan": "the fastest memory settings that fit a budget, written as a config",
    "export": "a checkpoint as a peft adapter, a merged model or a GGUF file",
    "generate": "completions of a file of prompts, from a checkpoint or an exported model",
    "make-demo-model": "a small pretrained model and a fine-tuning task, made locally",
}


def sentence(summary: str) -> str:
    return f"{summary[0].upper()}{summary[1:]}."


def description(name: str) -> str:
    """A subcommand's line as its ``--help`` description."""
    return sentence(OWN_SUBCOMMANDS[name])


def examples(docstring: str) -> str:
    """A command module's docstring after its first line (examples, and the arguments passed on to the config), as
    its ``--help`` epilog: plain text, its indentation kept."""
    return "examples:\n" + docstring.split("\n\n", 1)[1].replace("``", "`").rstrip()


def subcommand_parser(name: str, docstring: str, **options: Any) -> argparse.ArgumentParser:
    """The parser of one of this package's subcommands: its line as the description and its module's examples as
    the epilog (``examples``)."""
    return argparse.ArgumentParser(
        prog=f"pl-lowprec {name}",
        description=description(name),
        epilog=examples(docstring),
        formatter_class=argparse.RawDescriptionHelpFormatter,
        **options,
    )


def subcommand_lines() -> dict[str, str]:
    """Every subcommand with its line as a sentence: its help in ``pl-lowprec --help``'s list."""
    return {name: sentence(summary) for name, summary in {**LIGHTNING_SUBCOMMANDS, **OWN_SUBCOMMANDS}.items()}


def overview() -> str:
    """``pl-lowprec --help``'s description; the subcommands follow it, each with its line."""
    return (
        f"Low-precision fine-tuning on LightningCLI: Lightning's {_listed(LIGHTNING_SUBCOMMANDS)}, and the package's"
        f" {_listed(OWN_SUBCOMMANDS)}. `pl-lowprec --version` prints its version and those of torch, lightning,"
        " transformers and others."
    )


def _listed(names: Iterable[str]) -> str:
    """``a, b and c``."""
    *rest, last = names
    return f"{', '.join(rest)} and {last}"


def unknown_subcommand_paragraph(given: str | None) -> str:
    """The refusal of a missing (``None``) or unknown subcommand: the names, the nearest one, where the help is."""
    names = [*LIGHTNING_SUBCOMMANDS, *OWN_SUBCOMMANDS]
    if given is None:
        start = "a subcommand is needed (pl-lowprec SUBCOMMAND ...)."
    else:
        near = closest(given, names)
        start = f"{given!r} is not a subcommand{f'; did you mean {near!r}?' if near else '.'}"
    return (
        f"{start} The subcommands: {', '.join(names)}. `pl-lowprec --help` says what each does;"
        " `pl-lowprec SUBCOMMAND --help` lists its options."
    )


def package_options_epilog(subcommand: str) -> str:
    """The end of ``pl-lowprec fit|validate|test|predict --help``: where this package's strategy and precision
    arguments are. LightningCLI's help lists ``--trainer.strategy`` and ``--trainer.plugins`` as class paths only,
    so their arguments (quantization, lora, memory_saving; precision, loss_scale) and the strategy names were not
    on the page."""
    return (
        f"pl_lowprec: --trainer.strategy takes {', '.join(STRATEGY_NAMES)} (one device, DDP, FSDP2); their"
        " arguments (quantization, lora, activation_checkpointing, memory_saving, optimizer, pretrained, ...),"
        f" with docs and defaults: `pl-lowprec {subcommand} --trainer.strategy.help lowprec`. Mixed precision with"
        " a dynamic loss scaler is --trainer.plugins AMPPrecision; its arguments (precision auto, 16-mixed or"
        f" bf16-mixed, loss_scale, ...): `pl-lowprec {subcommand} --trainer.plugins.help AMPPrecision`. A full"
        f" config to start from: `pl-lowprec {subcommand} --config configs/quickstart.yaml --print_config`."
    )
