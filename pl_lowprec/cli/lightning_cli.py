"""``LowPrecisionCLI``: LightningCLI with this package's plugins, strategies and callbacks, and ``build_cli``.

Any ``LightningModule`` and ``LightningDataModule`` can be named by ``class_path`` in the YAML; the package's
classes are imported here, so jsonargparse also resolves them by short name (``class_path: AMPPrecision``), and
the strategies' names (``strategy: lowprec_ddp``) are registered.
"""

from __future__ import annotations

import re
import sys
import warnings
from argparse import ArgumentError
from pathlib import Path
from typing import Any

from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch.cli import LightningCLI, _get_module_type, _InstantiatorFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info

# The package's classes, imported so that a config can name them by short name; strategies also registers the
# strategy names ("lowprec", "lowprec_ddp", ...).
import pl_lowprec.callbacks
import pl_lowprec.data
import pl_lowprec.demo
import pl_lowprec.models
import pl_lowprec.plugins
import pl_lowprec.strategies
import pl_lowprec.transforms.fp8
import pl_lowprec.transforms.qat
import pl_lowprec.transforms.quantization  # noqa: F401
from pl_lowprec._checks import ResumeRefused
from pl_lowprec._imports import require_cli
from pl_lowprec.callbacks.replacements import use_package_callbacks
from pl_lowprec.cli.config_errors import (
    REFUSALS,
    ClassRefusals,
    class_key,
    debugging,
    parse_error_paragraph,
    raised_refusal,
    refusal_message,
    refusals,
    refuse,
    with_strategy_names,
)
from pl_lowprec.cli.deferred_optimizer import defer_configure_optimizers
from pl_lowprec.cli.empty_model import EmptyWhenPretrained
from pl_lowprec.cli.misplaced_keys import misplaced_key_hint
from pl_lowprec.cli.missing_loop import check_loop_defined, missing_loop_paragraph
from pl_lowprec.cli.own_options import meant_config_key
from pl_lowprec.cli.resume import check_checkpoint, check_same_run, finished_run_line, resolve_ckpt_path
from pl_lowprec.cli.strategy_override import strategy_names_as_classes
from pl_lowprec.cli.subcommands import (
    LIGHTNING_SUBCOMMANDS,
    OWN_SUBCOMMANDS,
    overview,
    package_options_epilog,
    subcommand_lines,
)
from pl_lowprec.strategies.trainer_checks import batches_started, check_trainer_arguments

DEFAULT_ROOT_DIR = "runs"


class LowPrecisionCLI(LightningCLI):
    """LightningCLI that writes under ``runs/`` by default, labels step-limited runs sensibly, and turns a bad
    configuration into one paragraph and exit status 2 (``pl_lowprec.cli.config_errors``)."""

    def init_parser(self, **kwargs: Any) -> Any:
        kwargs.setdefault("exit_on_error", False)  # parse_arguments words the error, not jsonargparse's dump
        return super().init_parser(**kwargs)

    def _add_configure_optimizers_method_to_model(self, subcommand: str | None) -> None:
        defer_configure_optimizers(self, subcommand)  # built from the parameters that train, once transformed

    def _add_subcommands(self, parser: Any, **kwargs: Any) -> None:
        """Lightning's four, then the package's own (``dispatch`` runs them before this parser is built), each with
        its line: ``pl-lowprec --help``'s usage and "Available subcommands" list every one. Lightning's four take the
        package's lines too: theirs are the Trainer methods' docstrings cut at a line's end ("It's separated from
        fit to make sure you never run on your")."""
        super()._add_subcommands(parser, **kwargs)
        subcommands = parser._subcommands_action
        lines = subcommand_lines()
        for choice in subcommands._choices_actions:
            choice.help = lines[choice.dest]
        for name in OWN_SUBCOMMANDS:
            subcommands.add_subcommand(name, self.init_parser(description=lines[name]), help=lines[name])

    def _prepare_subcommand_parser(self, klass: type, subcommand: str, **kwargs: Any) -> Any:
        parser = super()._prepare_subcommand_parser(klass, subcommand, **kwargs)
        parser.epilog = package_options_epilog(subcommand)  # LightningCLI names the strategy and plugins as classes
        return parser

    def add_arguments_to_parser(self, parser: Any) -> None:
        parser.set_defaults({"trainer.default_root_dir": DEFAULT_ROOT_DIR})
        parser.add_argument(
            "--allow_fresh_start",
            type=bool,
            default=False,
            help="With --ckpt_path: start from scratch when it finds no checkpoint (default: an error).",
        )
        parser.add_argument(
            "--allow_changed_hparams",
            type=bool,
            default=False,
            help="With --ckpt_path: use the config's model/data arguments where the checkpoint's differ"
            " (default: an error naming them).",
        )

    def _parse_ckpt_path(self) -> None:
        """The config's model is the one trained: a checkpoint of another model or data is refused first.

        LightningCLI would replace the config's model arguments with the checkpoint's, without a word."""
        with refusals():
            self._check_ckpt_path()

    def _check_ckpt_path(self) -> None:
        subcommand = self.config.get("subcommand")
        section = self.config[subcommand] if subcommand else None
        ckpt_path = section.get("ckpt_path") if section is not None else None
        if not ckpt_path or ckpt_path in ("last", "best", "hpc") or not Path(ckpt_path).exists():
            return  # resolved, and checked, once the Trainer exists (after_instantiate_classes)
        check_checkpoint(Path(ckpt_path))
        if section.get("model") is None:
            super()._parse_ckpt_path()
            return
        allowed = section.get("allow_changed_hparams", False)
        changed = check_same_run(Path(ckpt_path), section, allowed, resuming=subcommand == "fit")
        for line in changed:
            rank_zero_info(
                f"--allow_changed_hparams: {line}; the module gets the config's value (the optimizer and"
                " scheduler state, learning rate included, still come from the checkpoint)."
            )

    def after_instantiate_classes(self) -> None:
        """``--ckpt_path`` that finds nothing stops here, before any weight loads (unless --allow_fresh_start)."""
        if self.subcommand is None:
            return
        with refusals():
            self._resolve_ckpt_path()

    def _resolve_ckpt_path(self) -> None:
        section = self.config_init[self.subcommand]
        requested = section.get("ckpt_path")
        resolved = resolve_ckpt_path(self.trainer, requested, section.get("allow_fresh_start", False), self.subcommand)
        if requested is not None and resolved is None:
            rank_zero_info(
                f"--ckpt_path {requested}: no checkpoint found; starting from scratch (--allow_fresh_start)."
            )
            section["ckpt_path"] = None
        elif requested == "last" and resolved is not None:
            allowed = section.get("allow_changed_hparams", False)
            check_same_run(Path(resolved), self.config[self.subcommand], allowed, resuming=self.subcommand == "fit")
            section["ckpt_path"] = resolved  # Lightning's "last" searches only this run's new directory
            doing = "resuming" if self.subcommand == "fit" else f"{self.subcommand} uses"
            rank_zero_info(f"--ckpt_path last: {doing} {resolved}; this run logs to {self.trainer.log_dir}.")
        if self.subcommand == "fit" and section.get("ckpt_path") is not None:
            line = finished_run_line(Path(section["ckpt_path"]), self.trainer.max_steps)
            if line is not None:
                rank_zero_info(line)

    def parse_arguments(self, parser: Any, args: Any) -> None:
        from_argv = args is None
        given = sys.argv[1:] if from_argv else args
        if isinstance(given, list) and given[:1] and given[0] in OWN_SUBCOMMANDS:  # listed in the help, not run here
            refuse(
                f"{given[0]} is one of pl-lowprec's own subcommands, which LightningCLI does not run: call"
                f" pl_lowprec.cli.main([{given[0]!r}, ...]) (what the pl-lowprec command runs), not build_cli."
            )
        if isinstance(given, list):
            try:
                passed = strategy_names_as_classes(given)
            except ValueError as err:
                refuse(str(err))
            args = args if passed == given else passed
        try:
            with warnings.catch_warnings():
                if from_argv and args is not None:  # sys.argv, with strategy names as class_path
                    warnings.filterwarnings("ignore", message="LightningCLI's args parameter is intended")
                super().parse_arguments(parser, args)
        except ArgumentError as err:
            if debugging():
                raise
            paragraph, meant = parse_error_paragraph(str(err)), meant_config_key(str(err))
            if meant is not None:
                where = paragraph.split(":", 1)[0] if not meant.startswith("--") else ""
                paragraph = f"{paragraph.rstrip('.')}: did you mean {f'--{where}.{meant}' if where else meant}?"
            elif (home := misplaced_key_hint(str(err))) is not None:
                paragraph = f"{paragraph.rstrip('.')}. {home}"
            refuse(f"{paragraph}\n{_help_tip(args)}")

    def _add_instantiators(self) -> None:
        super()._add_instantiators()  # Lightning's, for the model and data (their hyperparameters)
        model_type = _get_module_type(self._model_class)
        lightnings = _InstantiatorFn(cli=self, key="model")
        empty = EmptyWhenPretrained(lightnings, self._subcommand_config)  # pretrained= on the strategy fills it
        self.parser.add_instantiator(empty, model_type, subclasses=self.subclass_mode_model, prepend=True)
        self.class_refusals = ClassRefusals()
        self.parser.add_instantiator(self.class_refusals, object)  # every other class

    def instantiate_classes(self) -> None:
        try:
            super().instantiate_classes()
        except (*REFUSALS, MisconfigurationException) as err:
            if debugging():
                raise
            refusal = (
                raised_refusal(err, (*REFUSALS, MisconfigurationException))
                or getattr(self, "class_refusals", ClassRefusals()).last()
            )
            if refusal is None:
                raise
            key = class_key(self._subcommand_config(), refusal.class_name) if refusal.class_name else None
            refuse(with_strategy_names(refusal.paragraph(key)))

    def instantiate_trainer(self, **kwargs: Any) -> Any:
        try:
            trainer = super().instantiate_trainer(**kwargs)
        except (ValueError, MisconfigurationException) as err:
            paragraph = precision_conflict_paragraph(err)
            if paragraph is None:
                raise
            raise ValueError(paragraph) from err
        check_trainer_arguments(trainer)
        use_package_callbacks(trainer)
        return trainer

    def _run_subcommand(self, subcommand: str) -> None:
        try:
            check_loop_defined(subcommand, self.model, self.datamodule)  # before weights load, not once they did
            super()._run_subcommand(subcommand)
        except (*REFUSALS, MisconfigurationException) as err:
            if debugging() or (batches_started(self.trainer) and not isinstance(err, ResumeRefused)):
                raise
            message = missing_loop_paragraph(subcommand, err) or refusal_message(err)
            refuse(f"{subcommand} stopped before its first step: {message}")

    def _subcommand_config(self) -> dict[str, Any]:
        config = self.config.as_dict()
        return config.get(self.subcommand, config) if self.subcommand else config


def precision_conflict_paragraph(err: BaseException) -> str | None:
    """Lightning's refusal of ``precision=`` beside a precision plugin (``plugins=<...AMPPrecision object at 0x..>``.
    Choose one.``), with how to change the plugin's precision or drop it; ``None`` for any other error."""
    found = re.search(
        r"Received both `precision=(?P<precision>[^`]+)` and `plugins=<(?P<plugin>[\w.]+) object", str(err)
    )
    if found is None:
        return None
    precision, plugin = found["precision"], found["plugin"].rpartition(".")[2]
    return (
        f"trainer.precision={precision} and the precision plugin {plugin} in trainer.plugins both set the precision,"
        " and Lightning accepts only one. To change the plugin's, set its own"
        f" (--trainer.plugins.init_args.precision={precision}, or init_args: {{precision: {precision}}} in the"
        " config) and leave trainer.precision unset; for Lightning's own precision instead, drop the plugin"
        " (--trainer.plugins=[])."
    )


def _help_tip(args: list[str] | None) -> str:
    argv = sys.argv[1:] if args is None else list(args)
    subcommand = next((a for a in argv if a in LIGHTNING_SUBCOMMANDS), "")
    return f"tip: `pl-lowprec {subcommand} --help`".replace("  ", " ") + " lists the options and their types."


def build_cli(
    args: list[str] | None = None, run: bool = True, cli_class: type[LowPrecisionCLI] = LowPrecisionCLI
) -> LowPrecisionCLI:
    """Parse ``args``, build the Trainer, model and data, and run the subcommand; return the LightningCLI."""
    require_cli()
    return cli_class(
        model_class=None,
        datamodule_class=None,
        subclass_mode_model=True,
        subclass_mode_data=True,
        args=args,
        run=run,
        save_config_kwargs={"overwrite": True},
        parser_kwargs={"prog": "pl-lowprec", "description": overview()},
    )
