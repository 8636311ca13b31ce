"""``pl-lowprec estimate --config X.yaml``: the memory estimate of a training config, before running it.

    pl-lowprec estimate --config configs/finetune-causal-lm.yaml
    pl-lowprec estimate --config configs/finetune-causal-lm.yaml --gpu T4 --plot step.png
    pl-lowprec estimate --config my.yaml --model.pretrained runs/demo/model --data.seq_len 1024
    pl-lowprec estimate --config my.yaml --json > estimate.json   (the figures for a script; the table on stderr)

Arguments the estimate does not know (``--model.pretrained DIR``, ``--data.seq_len 1024``,
``--trainer.strategy.quantization nf4-dq``) go to the config, as for ``pl-lowprec fit``, whose ``--help`` lists them.

The config is read by the parser ``pl-lowprec fit`` uses (``pl_lowprec.cli.rebuild``), so the same classes, short
names, defaults and refusals apply, and several ``--config`` files and overrides merge as they do for ``fit``.
No Trainer is built, so a config for a GPU is estimated on any machine; the model is built on the meta device
(nothing allocated); the data module is built for real, only to take the shape of one training batch. ``"auto"``
memory settings are estimated on their memory-saving side, as the device is not known here, and one more line says
from how much free memory ``fit`` takes the fastest settings, and their peak.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import torch
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import SingleDeviceStrategy

from pl_lowprec._imports import import_matplotlib_pyplot
from pl_lowprec.cli.config_errors import refuse, with_strategy_names
from pl_lowprec.cli.estimate_json import estimate_record
from pl_lowprec.cli.json_output import for_a_person
from pl_lowprec.cli.own_options import check_own_options
from pl_lowprec.cli.rebuild import passed_on, rebuild_classes
from pl_lowprec.cli.subcommands import subcommand_parser
from pl_lowprec.loading.sources import shapes_only
from pl_lowprec.memory.collectives import gradient_as_bucket_view
from pl_lowprec.memory.devices import GPUS, device_spec
from pl_lowprec.memory.estimate import MemoryEstimate, estimate_memory, resolved_precision
from pl_lowprec.memory.fastest import COMPILED_CAVEAT, faster_settings_line
from pl_lowprec.memory.plan import fresh_copies
from pl_lowprec.memory.plot import check_plot_path, plot_step
from pl_lowprec.memory.sizing_batch import first_config_batch, sizing_batch
from pl_lowprec.strategies.trainer_checks import check_accumulation, check_num_nodes
from pl_lowprec.strategy_names import registered_strategy
from pl_lowprec.transforms.dtypes import unified_precision


def precision_of(trainer: Any, gpu: str | None = None) -> str:
    """The config's precision: a precision plugin's request, else the trainer's ``precision``, else ``"32-true"``,
    Lightning's aliases normalised as Lightning does (``unified_precision``: ``bf16`` is ``"bf16-mixed"``).
    ``AMPPrecision``'s ``"auto"`` stays (``estimate_memory`` chooses it for the device), or with ``gpu`` is chosen
    for that GPU (``resolved_precision``)."""
    requested = str(getattr(trainer, "precision", None) or "32-true")
    for plugin in getattr(trainer, "plugins", None) or []:
        if isinstance(plugin, Precision):
            requested = str(getattr(plugin, "requested_precision", plugin.precision))
            break
    if gpu is None:
        precision = unified_precision(requested)  # Lightning's aliases as it runs them: "bf16" is "bf16-mixed"
        if precision == "auto" and device_of(trainer) == "cuda" and not torch.cuda.is_available():
            resolved_precision(precision, "cuda")  # refused here, before the config's data is read: --gpu NAME
        return precision
    return resolved_precision(requested, device_of(trainer, gpu), gpu)


def device_of(trainer: Any, gpu: str | None = None) -> str:
    """The device type a config's ``trainer.accelerator`` runs on, as Lightning would pick it here; ``cuda`` for
    the run on a named ``gpu`` (``--gpu``)."""
    if gpu is not None and gpu.lower() != "cpu":
        return "cuda"
    accelerator = str(getattr(trainer, "accelerator", None) or "auto")
    if accelerator in ("gpu", "cuda") or (accelerator == "auto" and torch.cuda.is_available()):
        return "cuda"
    return "cpu"


def estimate_config(cli_args: list[str], time_on: str | None = None) -> MemoryEstimate:
    """The estimate for ``--config X.yaml`` (and overrides), as ``pl-lowprec fit`` would build the run; its step
    time on ``time_on`` (a GPU of ``memory.devices.GPUS``), else on the config's device."""
    return estimate_memory(**estimate_arguments(cli_args), time_on=time_on)


def estimate_arguments(cli_args: list[str], said: list[str] | None = None, gpu: str | None = None) -> dict[str, Any]:
    """``estimate_memory``'s arguments for ``--config X.yaml`` (and overrides), as ``pl-lowprec fit`` would build
    the run; the batch's shape in words is appended to ``said`` (``sizing_batch``). ``gpu`` (``--gpu``): the run
    on that GPU, CUDA memory and ``precision: auto`` as ``AMPPrecision`` chooses it there."""
    run = rebuild_classes(cli_args)
    trainer = run.config_init.trainer
    check_strategy(trainer)
    check_devices(trainer)
    precision = precision_of(trainer, gpu)
    first, source = first_config_batch(run.model, run.datamodule, "estimate")
    tokenizer_line = checked_tokenizer(run.model, run.datamodule)
    batch, shape = sizing_batch(first, source)
    if said is not None:
        said.append(f"Batch: {shape}.")
        said += [tokenizer_line] if tokenizer_line else []
        if gpu is not None and precision_of(trainer) == "auto":
            said.append(f"Precision: {precision}, as AMPPrecision('auto') chooses it on the {gpu}.")
    strategy = trainer.strategy
    config = getattr(strategy, "transform_config", None)  # None: not this package's strategy
    sharding = strategy.transform_sharding(config) if hasattr(strategy, "transform_sharding") else None
    return {
        "build_model": fresh_copies(run.model),  # a meta copy each call: each estimate transforms its own
        "example_batch": batch,
        "precision": precision,
        "device": device_of(trainer, gpu),
        "config": config,
        "accumulate_grad_batches": int(getattr(trainer, "accumulate_grad_batches", None) or 1),
        "sharding": sharding,
        "world_size": devices_of(trainer),  # sharded: the memory per rank; else DDP's all-reduce in the step time
        "gradient_as_bucket_view": gradient_as_bucket_view(strategy),  # DDP's buckets are then the gradients
    }


def checked_tokenizer(model: Any, datamodule: Any) -> str | None:
    """The module's own check of the data's tokenizer, as ``fit`` runs it (``CausalLM.check_data_tokenizer``:
    another model's tokenizer is refused where the model directory holds its own); and, where the tokenizer has
    less than half the model's vocabulary (a shapes-only directory with some other tokenizer), a line saying the
    batch lengths follow it. ``None`` where there is nothing to say."""
    tokenizer = getattr(datamodule, "tokenizer", None)
    check = getattr(model, "check_data_tokenizer", None)
    if tokenizer is None or not callable(check):
        return None
    check(tokenizer, getattr(datamodule, "tokenizer_dir", None))
    vocab = getattr(getattr(model, "config", None), "vocab_size", None)
    if not isinstance(vocab, int) or len(tokenizer) * 2 >= vocab:
        return None
    return (
        f"Tokenizer: {len(tokenizer):,} tokens for a model of vocab_size {vocab:,}, so not the model's own: the"
        " batch lengths, and the estimate, follow the tokenizer given (--data.tokenizer)."
    )


def check_strategy(trainer: Any) -> None:
    """A ``strategy=`` string that names no registered strategy (a typo, or a class path given as an override,
    which jsonargparse keeps as a plain string) refused in the paragraph ``fit`` refuses it with, rather than
    estimated as an untransformed single-device run."""
    strategy = getattr(trainer, "strategy", None)
    if not isinstance(strategy, str) or strategy.lower() == "auto" or registered_strategy(strategy.lower()):
        return
    class_path_hint = (
        " A class path is given as trainer.strategy.class_path (with its init_args), not as"
        " --trainer.strategy=<class path>."
    )
    refuse(
        with_strategy_names(
            f"Trainer: You selected an invalid strategy name: `strategy={strategy.lower()!r}`. It must be either a"
            " string or an instance of `lightning.pytorch.strategies.Strategy`. Example choices: auto, ddp,"
            " ddp_spawn, deepspeed, ... Find a complete list of options in our documentation at https://lightning.ai"
            "."
        )
        + (class_path_hint if "." in strategy else "")
    )


def check_devices(trainer: Any) -> None:
    """``trainer.devices`` as Lightning accepts it (the Trainer, which would check it, is not built here); and
    ``accumulate_grad_batches`` and ``num_nodes`` refused as ``fit`` refuses them (0 is no count of either)."""
    if getattr(trainer, "accumulate_grad_batches", None) is not None:  # None: Lightning's default, 1
        check_accumulation(trainer.accumulate_grad_batches)
    if getattr(trainer, "num_nodes", None) is not None:
        check_num_nodes(trainer.num_nodes)
    devices = getattr(trainer, "devices", None)
    if not _valid_devices(devices):
        raise ValueError(
            f"trainer.devices={devices!r} is not a number of devices: give a count >= 1 (devices: 2), a list of"
            " device indices ([0, 1]), or -1 / 'auto' (every device there is)."
        )


def _valid_devices(devices: Any) -> bool:
    if devices is None or devices in ("auto", -1, "-1"):
        return True
    if isinstance(devices, str):
        parts = [part.strip() for part in devices.split(",")]
        if len(parts) == 1:
            return parts[0].isdigit() and int(parts[0]) >= 1
        return all(part.isdigit() for part in parts)
    if isinstance(devices, (list, tuple)):
        return bool(devices) and all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in devices)
    return isinstance(devices, int) and not isinstance(devices, bool) and devices >= 1


def devices_of(trainer: Any) -> int:
    """The ranks the config runs on: ``devices`` (a count or a list) times ``num_nodes``. ``"auto"`` or ``-1``
    resolve as Lightning resolves them on this machine: one rank for a single-device strategy or on a CPU, every
    GPU here on CUDA. A CUDA config with DDP or FSDP, estimated on a machine without a GPU, is refused: the
    estimate is per rank of a known number (FSDP shards over the ranks; DDP all-reduces across them)."""
    if _single_device(trainer):
        return 1  # Lightning runs one process for a single-device strategy, whatever devices says
    devices = getattr(trainer, "devices", None)
    count = len(devices) if isinstance(devices, (list, tuple)) else devices
    if isinstance(count, str) and count.isdigit():
        count = int(count)
    if not isinstance(count, int) or count < 1:
        count = _automatic_devices(trainer, devices)
    return count * int(getattr(trainer, "num_nodes", None) or 1)


def _single_device(trainer: Any) -> bool:
    registered = registered_strategy(str(getattr(trainer, "strategy", None)))  # a name, as a config may give it
    strategy_class = registered[0] if registered is not None else type(getattr(trainer, "strategy", None))
    return isinstance(strategy_class, type) and issubclass(strategy_class, SingleDeviceStrategy)


def _automatic_devices(trainer: Any, devices: Any) -> int:
    if device_of(trainer) == "cpu":
        return 1  # Lightning runs one CPU process for devices="auto"
    if torch.cuda.is_available():
        return torch.cuda.device_count()
    raise ValueError(
        f"trainer.devices={devices!r} on CUDA, estimated on a machine without a GPU: a DDP or FSDP estimate is per"
        " rank of a known number (FSDP shards the model over the ranks; DDP all-reduces the gradients across"
        " them). Set trainer.devices to the count the run will use (devices: 2) in the config or with"
        " --trainer.devices=2."
    )


def step_time_line(estimate: MemoryEstimate) -> str:
    """The predicted step time, or why there is none (a CUDA config estimated where there is no GPU)."""
    step = estimate.step_time
    if step is None:
        return (
            "Step time not predicted: the config runs on CUDA and this machine has no GPU with known figures;"
            f" name one with --gpu ({', '.join(GPUS)})."
        )
    per_rank = f" (per rank of {estimate.world_size})" if estimate.world_size > 1 else ""
    return step.line() + per_rank


@shapes_only()  # a pretrained= directory with only config.json: an estimate needs the shapes, not the weights
def main(args: list[str] | None = None) -> None:
    parser = subcommand_parser("estimate", __doc__, allow_abbrev=False)
    parser.add_argument(
        "--config",
        action="append",
        required=True,
        help="a YAML file that `pl-lowprec fit --config` runs (several merge, as for fit)",
    )
    parser.add_argument("--plot", metavar="FILE.png", help="draw the step as stacked categories (needs matplotlib)")
    parser.add_argument("--gpu", help=f"predict the step time on this GPU ({', '.join(GPUS)}); default: here")
    parser.add_argument(
        "--json",
        action="store_true",
        help="print the estimate as one JSON object on stdout (bytes, seconds), the lines for a person on stderr",
    )
    args = sys.argv[1:] if args is None else list(args)
    options, unknown = parser.parse_known_args(args)
    check_own_options(parser, unknown)
    if options.plot:
        import_matplotlib_pyplot()  # a missing matplotlib fails before the estimate runs
        check_plot_path(options.plot)  # so does a directory that does not exist
    if options.gpu is not None:  # "" too: an empty name is refused here, not after the config is read
        device_spec(options.gpu)  # an unknown GPU is refused (``dispatch``'s refusals) before the estimate runs
    with for_a_person(options.json):  # with --json, stdout holds the JSON alone
        said: list[str] = []
        arguments = estimate_arguments(passed_on(parser, args), said, options.gpu)
        estimate = estimate_memory(**arguments, time_on=options.gpu)
        print(*said, sep="\n")
        print(estimate.table())
        print(step_time_line(estimate))
        config = arguments["config"]
        if config is not None and config.compile_kwargs is not None:
            print(COMPILED_CAVEAT.strip())
        if config is not None and config.chooses_automatically:  # the device is not known here: the faster choice
            line = faster_settings_line(**arguments)
            if line is not None:
                print(line)
                said.append(line)
        if options.plot:
            print(f"Plot: {plot_step(estimate, options.plot)}")
    if options.json:
        print(json.dumps(estimate_record(estimate, arguments["precision"], said), indent=1))
