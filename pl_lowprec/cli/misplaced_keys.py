"""A config key refused where it stands, with where it belongs.

jsonargparse refuses ``trainer: {quantization: nf4}`` as "Subcommand 'fit' does not accept option
'trainer.quantization'", ``--trainer.lr 0.1`` as "unrecognized arguments", and ``model: {init_args: {lora: ...}}``
as "Option 'lora.r' is not accepted": true, but it does not say that ``quantization`` and ``lora`` are arguments of
the strategy (``trainer.strategy.init_args``) and ``lr`` of the model. ``misplaced_key_hint`` names the section
that takes the key, for the Trainer and the package's own classes (strategy, precision plugin, ``CausalLM``,
``TextDataModule``).
"""

from __future__ import annotations

from dataclasses import dataclass

from lightning.pytorch import Trainer

from pl_lowprec.cli.own_options import refused_key
from pl_lowprec.data import TextDataModule
from pl_lowprec.models import CausalLM
from pl_lowprec.plugins import AMPPrecision
from pl_lowprec.strategies import LowPrecisionStrategy
from pl_lowprec.strategies.signature import keyword_arguments


@dataclass(frozen=True)
class Home:
    """A section of the config that takes some keys: where they go in YAML and on the command line."""

    owner: str
    section: str  # the config section, without the key
    option: str  # the command-line prefix, without the key
    example: str  # the config file that shows the section


def _homes() -> list[tuple[Home, list[str]]]:
    trainer = set(keyword_arguments(Trainer))
    plugin_only = [name for name in keyword_arguments(AMPPrecision) if name not in trainer]
    strategy = [name for name in keyword_arguments(LowPrecisionStrategy) if name not in ("device", "accelerator")]
    return [
        (Home("the Trainer", "trainer", "--trainer", "configs/quickstart.yaml"), sorted(trainer)),
        (
            Home(
                "the strategy (pl_lowprec.LowPrecisionStrategy and its DDP/FSDP forms)",
                "trainer.strategy.init_args",
                "--trainer.strategy",
                "configs/qlora-nf4-bf16.yaml",
            ),
            strategy,
        ),
        (
            Home(
                "the precision plugin (pl_lowprec.AMPPrecision)",
                "trainer.plugins[].init_args",
                "--trainer.plugins.init_args",
                "configs/amp-fp16.yaml",
            ),
            plugin_only,
        ),
        (
            Home("the model (as CausalLM takes it)", "model.init_args", "--model", "configs/finetune-causal-lm.yaml"),
            keyword_arguments(CausalLM),
        ),
        (
            Home(
                "the data module (as TextDataModule takes it)",
                "data.init_args",
                "--data",
                "configs/finetune-causal-lm.yaml",
            ),
            keyword_arguments(TextDataModule),
        ),
    ]


def misplaced_key_hint(message: str) -> str | None:
    """Where the key jsonargparse refused in ``message`` belongs, in words; ``None`` where no other section that
    this knows takes it (a misspelling: ``own_options.meant_config_key`` suggests the key meant)."""
    refused = refused_key(message)
    if refused is None:
        return None
    section, key = refused.section, refused.key
    name = key.split(".")[0]
    section = section.removesuffix(".init_args")
    for home, names in _homes():
        if name not in names or home.section.removesuffix(".init_args") == section:
            continue
        return (
            f"`{name}` is an argument of {home.owner}, not of {section or 'the top level'}. Put it under"
            f" {home.section} (as {home.example} does), or on the command line {home.option}.{name}=VALUE."
        )
    return None
