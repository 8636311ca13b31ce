"""``pl-lowprec plan --config X.yaml --memory 24GiB``: the fastest memory settings that fit, as a config to run.

    pl-lowprec plan --config configs/finetune-causal-lm.yaml --memory 16GiB --gpu T4
    pl-lowprec plan --config configs/finetune-causal-lm.yaml --memory 24GiB --out runs/plan.yaml
    pl-lowprec plan --config my.yaml --memory 80GB --maximize seq_len --out runs/long.yaml --data.batch_size 4
    pl-lowprec plan --config my.yaml --memory 24GiB --json > plan.json   (the plan for a script; the table on stderr)

Arguments the plan does not know (``--model.pretrained DIR``, ``--data.batch_size 4``, ``--trainer.devices 2``)
go to the config, as for ``pl-lowprec fit``, whose ``--help`` lists them; the written config keeps them.

The config is read as ``pl-lowprec estimate`` reads it (``rebuild_classes``: no Trainer, the model on the meta
device; several ``--config`` files and overrides merge as for ``fit``). Every candidate of
``pl_lowprec.memory.plan`` is simulated; the table ranked by predicted step time (on the config's device, or
``--gpu``) is printed, then one "Chosen:" line naming what the plan chose and what it kept as the config gives it
(pinned), and the fastest candidate that fits is written with ``--out`` as the same YAML (the configs merged) with
only the searched settings changed, so ``pl-lowprec fit --config plan.yaml`` runs it as is; never over a config it
reads. ``--maximize seq_len`` (or ``batch_size``) instead finds the longest sequence (or largest
micro-batch) that fits with the most memory-saving settings the config allows.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import inspect
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import yaml
from lightning.pytorch.strategies import SingleDeviceStrategy

from pl_lowprec._checks import int_at_least
from pl_lowprec.cli.arguments import options, read_config
from pl_lowprec.cli.estimate import check_devices, check_strategy, device_of, devices_of, precision_of
from pl_lowprec.cli.json_output import for_a_person
from pl_lowprec.cli.own_options import check_own_options
from pl_lowprec.cli.plan_json import maximize_record, plan_record
from pl_lowprec.cli.rebuild import config_files, passed_on, rebuild_classes
from pl_lowprec.cli.subcommands import subcommand_parser
from pl_lowprec.distributed.sharding import Sharding
from pl_lowprec.export.out_paths import refuse_inputs
from pl_lowprec.loading.sources import shapes_only
from pl_lowprec.memory.collectives import gradient_as_bucket_view
from pl_lowprec.memory.devices import GPUS, device_spec
from pl_lowprec.memory.estimate import estimate_memory
from pl_lowprec.memory.fake_step import batch_tensors
from pl_lowprec.memory.fastest import MemorySettings, configured, ladder
from pl_lowprec.memory.plan import (
    Settings,
    block_names,
    checkpointed_blocks,
    fresh_copies,
    largest_by_doubling,
    plan_memory,
    resized,
    searched_config,
    settings_config,
    weights_advice,
)
from pl_lowprec.memory.quiet import quiet_setup_logs
from pl_lowprec.memory.sizes import format_bytes, parse_bytes
from pl_lowprec.memory.sizing_batch import first_config_batch, sizing_batch
from pl_lowprec.memory.step_time import StepTime, duration
from pl_lowprec.strategies.fsdp import check_fsdp_arguments
from pl_lowprec.strategies.transform_args import TransformArguments
from pl_lowprec.transforms.checkpointing import declared_blocks
from pl_lowprec.transforms.config import TransformConfig
from pl_lowprec.transforms.memory_saving import ALL_PATHS, AUTO, PATHS

MAX_SEQ_LEN = 1 << 20


@shapes_only()  # a pretrained= directory with only config.json: a plan needs the shapes, not the weights
def main(args: list[str] | None = None) -> None:
    parser = subcommand_parser("plan", __doc__, allow_abbrev=False)
    parser.add_argument(
        "--config",
        action="append",
        required=True,
        help="a YAML file that `pl-lowprec fit --config` runs (several merge, as for fit)",
    )
    parser.add_argument("--memory", required=True, help="device memory per device: 24GiB, 80GB, 512MiB or bytes")
    parser.add_argument(
        "--devices", type=int_at_least(1), default=None, help="devices to plan for (default: the config's)"
    )
    parser.add_argument("--margin", type=float, default=0.1, help="fraction of --memory kept free (default 0.1)")
    parser.add_argument("--out", help="write the chosen config here (refused if it exists, unless --overwrite)")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing --out file")
    parser.add_argument("--maximize", choices=["seq_len", "batch_size"], help="the largest value that fits")
    parser.add_argument("--allow_quantization", action="store_true", help="also try nf4-dq base weights")
    parser.add_argument("--gpu", help=f"rank by the predicted step time on this GPU ({', '.join(GPUS)})")
    parser.add_argument(
        "--json",
        action="store_true",
        help="print the plan as one JSON object on stdout (bytes, seconds), the lines for a person on stderr",
    )
    args = sys.argv[1:] if args is None else list(args)
    options, unknown = parser.parse_known_args(args)
    check_own_options(parser, unknown)
    with for_a_person(options.json):  # with --json, stdout holds the JSON alone
        record = _plan(parser, options, args)
    if options.json:
        print(json.dumps(record, indent=1))
    found = record["chosen"] if "chosen" in record else record["largest"]
    if found is None:
        raise SystemExit(1)  # nothing fits: said on stderr


def _plan(parser: argparse.ArgumentParser, options: argparse.Namespace, args: list[str]) -> dict[str, Any]:
    """The plan (or ``--maximize``'s search) of ``options``, printed for a person and written with ``--out``;
    returned as ``plan --json`` prints it."""
    cli_args = passed_on(parser, args)  # the --config files and overrides, in order
    budget = parse_bytes(options.memory, "--memory")
    if not 0 <= options.margin < 1:
        raise ValueError(f"--margin={options.margin} must be a fraction in [0, 1), such as 0.1 (10% kept free).")
    out = Path(options.out) if options.out else None
    if out is not None:
        refuse_inputs(out, config_files(cli_args))  # never over a config it reads, --overwrite or not
        if out.exists() and not options.overwrite:
            raise ValueError(f"--out {out} exists: pass --overwrite to replace it, or another path.")
    if options.gpu is not None:  # "" too: an empty name is refused here, not after the config is read
        device_spec(options.gpu)  # an unknown GPU: refused before the config is read
    run = rebuild_classes(cli_args)
    trainer = run.config_init.trainer
    check_strategy(trainer)
    check_devices(trainer)
    precision, device = precision_of(trainer, options.gpu), device_of(trainer, options.gpu)
    given = getattr(trainer.strategy, "transform_config", None)
    config = searched_config(given) if given is not None else None
    if config is None:
        parser.exit(
            2,
            "pl-lowprec plan: the config needs one of pl_lowprec's strategies (trainer.strategy: lowprec,"
            " lowprec_ddp or lowprec_fsdp): the plan changes the strategy's memory settings.\n",
        )
    if options.maximize and run.datamodule is None:
        raise ValueError(
            f"--maximize {options.maximize} changes the data module's {options.maximize}, and the config names no"
            " data module (data: class_path ...): the module's own train_dataloader has no setting to change."
            " Plan without --maximize, or give the data as a data module."
        )
    batch, shape = sizing_batch(*first_config_batch(run.model, run.datamodule, "plan"))
    print(f"Batch: {shape}.")
    rows = next(t.shape[0] for t in batch_tensors(batch))
    accumulate = int(getattr(trainer, "accumulate_grad_batches", None) or 1)
    devices = options.devices or devices_of(trainer)
    build = fresh_copies(run.model)
    blocks = _block_names(build, config)
    strategy = trainer.strategy
    sharding = strategy.transform_sharding(given) if hasattr(strategy, "transform_sharding") else None
    bucket_view = gradient_as_bucket_view(strategy)  # DDP's buckets are then the gradients
    if options.maximize:
        shards = (sharding, devices, bucket_view)
        shape = (rows, accumulate)
        return _maximize(options, build, batch, shape, budget, precision, device, config, blocks, cli_args, run, shards)
    plan = plan_memory(
        build,
        lambda micro: resized(batch, micro),
        budget,
        rows * accumulate * devices,
        precision,
        device,
        config,
        devices,
        options.margin,
        options.allow_quantization,
        blocks,
        sharding=sharding,
        time_on=options.gpu,
        micro_batch=None if run.datamodule is not None else rows,  # a module's own loader: its batch stays
        gradient_as_bucket_view=bucket_view,
    )
    print(plan.table())
    switch_to: dict[str, Any] | None = None
    if devices > 1 and sharding is None:
        global_batch = rows * accumulate * devices
        make_plan = functools.partial(
            plan_memory,
            build,
            lambda micro: resized(batch, micro),
            budget,
            global_batch,
            precision,
            device,
            config,
            time_on=options.gpu,
        )
        sharded, line = _sharded_alternative(make_plan, config, devices, options, blocks, plan.chosen)
        print(line)
        if sharded is not None:  # nothing fits unsharded and sharding may change what it needs to: switch
            print(sharded.table())
            plan, switch_to = sharded, {"shard_modules": block_names(checkpointed_blocks(config, blocks))}
    chosen = plan.chosen
    if chosen is None:
        print(plan.nothing_fits(), file=sys.stderr)
        return plan_record(plan, precision, devices, out)
    print(plan.chosen_line())
    if out is not None:
        write_plan(cli_args, out, chosen.settings, blocks, config, devices, run, strategy=switch_to, rows=rows)
        print(f"Wrote {out}: pl-lowprec fit --config {out}")
    return plan_record(plan, precision, devices, out)


def _sharded_alternative(
    make_plan: Callable[..., Any],
    config: TransformConfig,
    devices: int,
    options: argparse.Namespace,
    blocks: list[str] | None,
    unsharded: Any | None,
) -> tuple[Any, str]:
    """The same devices sharded with ``lowprec_fsdp``, and a line saying it, beside ``unsharded`` (the candidate
    chosen without sharding, ``None`` where none fits). The sharded plan is returned (to be chosen and written)
    only when nothing fits unsharded, it fits, and switching changes nothing else: without 4-bit weights, or with
    ``--allow_quantization``, since FSDP2 stores them as torchao NF4 instead of bitsandbytes' (the same NF4 code
    book, other scale blocks)."""
    units = checkpointed_blocks(config, blocks)
    try:
        check_fsdp_arguments(config, 1)
        if not units:
            raise ValueError("no repeated blocks to shard")
    except ValueError as why:
        return None, f"Sharding over {devices} devices (lowprec_fsdp) was not simulated: {why}"
    sharded = make_plan(devices, options.margin, options.allow_quantization, blocks, sharding=Sharding(units=units))
    best = sharded.chosen or min(sharded.candidates, key=lambda c: c.peak)
    fits = "fits" if sharded.chosen is not None else "does not fit either"
    said = (
        f"Sharded over {devices} devices instead (trainer.strategy: {FSDP_STRATEGY}), the best candidate {fits}:"
        f" {best.settings.describe()}, predicted {format_bytes(best.peak)} per rank."
    )
    if sharded.chosen is None:
        return None, said
    if unsharded is not None:
        return None, f"{said} Not chosen: the unsharded candidate above fits ({_steps(unsharded.step, best.step)})."
    if config.quantization is not None and not options.allow_quantization:
        return None, (
            f"{said} Not chosen: under FSDP2 the 4-bit weights are stored as torchao NF4 instead of bitsandbytes'"
            " (other scale blocks), which changes the model; pass --allow_quantization to choose it."
        )
    return sharded, f"{said} Chosen, since nothing fits unsharded:"


FSDP_STRATEGY = "pl_lowprec.LowPrecisionFSDPStrategy"
DDP_STRATEGY = "pl_lowprec.LowPrecisionDDPStrategy"


def _steps(unsharded: StepTime, sharded: StepTime) -> str:
    """The two predicted steps in words, the sharded one with its collectives."""
    if sharded.interconnect:
        talk = f", {duration(sharded.collective_seconds)} of collectives on {sharded.interconnect} among them"
    else:
        talk = f", its {sharded.collectives:,} collectives not timed" if sharded.collectives else ""
    return f"predicted {unsharded.seconds:.3f} s a step, against {sharded.seconds:.3f} s sharded{talk}"


def _eight_bit(sharding: Any) -> str:
    """The 8-bit AdamW the strategy takes: torchao's under ``lowprec_fsdp`` (it steps on shards)."""
    return "torchao_adamw8bit" if sharding is not None else "adamw8bit"


def _maximize(
    options, build, batch, shape, budget, precision, device, config, blocks, cli_args, run, shards
) -> dict[str, Any]:
    """The longest sequence (or largest micro-batch) that fits, with the most memory-saving settings allowed;
    ``shape``: the config's micro-batch rows and accumulation; ``shards``: the config's FSDP2 sharding (or
    ``None``), the number of ranks and DDP's ``gradient_as_bucket_view``.

    ``seq_len`` keeps the global batch: it is searched at micro-batch 1 with the accumulation that makes up the
    config's rows per device, and written so. It stops at the model's ``max_position_embeddings`` (positions past
    it were never trained). ``batch_size`` changes the global batch by its nature, and says by how much."""
    sharding, world_size, bucket_view = shards
    rows, accumulate = shape
    limit = int(budget * (1 - options.margin))
    longest = options.maximize == "seq_len"
    rungs, _ = ladder(build, precision, torch.device(device), config, blocks)
    saving = Settings(
        micro_batch=1 if longest else rows,
        accumulate=rows * accumulate if longest else accumulate,
        memory=rungs[-1],  # the most memory-saving of fit's own candidates
        optimizer=_eight_bit(sharding) if config.optimizer in (None, "adamw") else config.optimizer,
        activation_offloading=device == "cuda",
        quantization="nf4-dq" if options.allow_quantization and config.quantization is None else None,
    )
    transform = settings_config(config, saving, blocks)
    seq_len = next(t.shape[1] for t in batch_tensors(batch) if t.dim() >= 2)

    def fits(value: int) -> bool:
        micro, length = (saving.micro_batch, value) if longest else (value, seq_len)
        with quiet_setup_logs():
            estimate = estimate_memory(
                build,
                resized(batch, micro, length),
                precision=precision,
                device=device,
                config=transform,
                accumulate_grad_batches=saving.accumulate,
                sharding=sharding,
                world_size=world_size,
                gradient_as_bucket_view=bucket_view,
            )
        return estimate.peak <= limit

    positions = trained_positions(configured(build))
    ceiling = (positions or MAX_SEQ_LEN) if longest else MAX_BATCH_SIZE
    start = min(seq_len if longest else 1, 16, ceiling)
    up_to = f"the model's max_position_embeddings, {positions}" if longest and positions else f"{ceiling}"
    print(f"Searching the largest {options.maximize} up to {up_to}, with {saving.describe()}.", flush=True)
    best = largest_by_doubling(fits, start, ceiling)
    if best is None:
        mode = saving.quantization or (config.quantization.mode if config.quantization is not None else None)
        print(
            f"Nothing fits in {format_bytes(limit)} even at {options.maximize}={start} with"
            f" {saving.describe()}: the weights and optimizer state alone are too large. For the weights,"
            f" {weights_advice(mode)}; or plan for a larger device.",
            file=sys.stderr,
        )
        return maximize_record(options.maximize, None, saving, limit, options.out)
    capped = " (the model's max_position_embeddings)" if longest and best == positions else ""
    print(f"Largest {options.maximize} that fits in {format_bytes(limit)} with {saving.describe()}: {best}{capped}")
    if not longest:
        before, after = rows * accumulate * world_size, best * accumulate * world_size
        print(
            f"The global batch becomes {after} rows a step"
            f" (the config's: {before}): the learning rate may need to follow."
        )
    if options.out:
        written = saving if longest else dataclasses.replace(saving, micro_batch=best)
        extra = {"data.init_args.seq_len": best} if longest else {}
        write_plan(cli_args, Path(options.out), written, blocks, config, world_size, run, extra, rows=rows)
        print(f"Wrote {options.out}: pl-lowprec fit --config {options.out}")
    return maximize_record(options.maximize, best, saving, limit, options.out)


MAX_BATCH_SIZE = 4096


def trained_positions(model: Any) -> int | None:
    """The longest sequence the model was trained for: ``max_position_embeddings`` of the first Hugging Face
    config among its modules (``None`` where none says)."""
    for module in model.modules():
        positions = getattr(getattr(module, "config", None), "max_position_embeddings", None)
        if isinstance(positions, int) and positions > 0:
            return positions
    return None


def write_plan(
    cli_args: list[str],
    out: Path,
    settings: Settings,
    blocks: list[str] | None,
    config: TransformConfig,
    devices: int,
    run: Any,
    extra: dict[str, Any] | None = None,
    strategy: dict[str, Any] | None = None,
    rows: int | None = None,
) -> None:
    """The ``--config`` files merged with the command line's overrides (``cli_args``, in order) and only the searched
    settings changed. ``strategy``: switch to ``lowprec_fsdp`` with these arguments, keeping the model arguments
    (``TransformArguments``). ``rows``: the config's micro-batch, from which the Trainer's counts of batches are
    rescaled (``rescaled_batch_counts``)."""
    fields = merged_fields(cli_args)
    node = fields.setdefault("trainer", {}).get("strategy")
    if not isinstance(node, dict):
        built = type(run.config_init.trainer.strategy)
        node = fields["trainer"]["strategy"] = {"class_path": f"{built.__module__}.{built.__qualname__}"}
    switch = (FSDP_STRATEGY, strategy) if strategy is not None else None
    if switch is None and devices > 1 and isinstance(run.config_init.trainer.strategy, SingleDeviceStrategy):
        # planned for several devices (--devices), simulated with DDP's all-reduce: a single-device strategy would
        # run one process with 1/devices of the planned global batch
        switch = (DDP_STRATEGY, {})
        print(f"trainer.strategy: {DDP_STRATEGY}, as planned for {devices} devices (the config's runs one device).")
    if switch is not None:
        model_arguments = inspect.signature(TransformArguments.__init__).parameters
        kept = {k: v for k, v in (node.get("init_args") or {}).items() if k in model_arguments}
        node = fields["trainer"]["strategy"] = {"class_path": switch[0], "init_args": {**kept, **switch[1]}}
    planned = settings_config(config, settings, blocks)
    chosen_paths = planned.memory_saving if settings.memory.paths_given else _all_or_none(settings.memory)
    changes = {
        "trainer.accumulate_grad_batches": settings.accumulate,
        **({"data.init_args.batch_size": settings.micro_batch} if run.datamodule is not None else {}),
        "trainer.strategy.init_args.activation_checkpointing": block_names(planned.activation_checkpointing),
        "trainer.strategy.init_args.checkpoint_every_n": planned.checkpoint_every_n,
        "trainer.strategy.init_args.checkpoint_mode": planned.checkpoint_mode,
        "trainer.strategy.init_args.optimizer": planned.optimizer,
        "trainer.strategy.init_args.activation_offloading": planned.activation_offloading,
        "trainer.strategy.init_args.memory_saving": _memory_saving(chosen_paths),
        **(extra or {}),
    }
    if settings.quantization is not None:
        changes["trainer.strategy.init_args.quantization"] = settings.quantization
    if devices != 1 or "devices" in fields["trainer"]:
        changes["trainer.devices"] = devices
    for key, value in changes.items():
        _set(fields, key, value)
    for line in rescaled_batch_counts(fields["trainer"], rows or settings.micro_batch, settings.micro_batch):
        print(line)
    sources = " + ".join(str(path) for path in config_files(cli_args).values())
    header = f"# Written by pl-lowprec plan from {sources}: {settings.describe()}.\n"
    out.write_text(header + yaml.safe_dump(fields, sort_keys=False))


def _all_or_none(rung: MemorySettings) -> frozenset[str]:
    """The paths a chosen rung turns on, as every path where it turns on all that apply to the run (the others
    change nothing), so that the written config says ``true`` rather than a list."""
    return ALL_PATHS if rung.paths and rung.paths == rung.applicable else rung.paths


def _memory_saving(paths: frozenset[str]) -> bool | list[str]:
    """The paths the plan simulated, as ``memory_saving:`` in YAML: never ``"auto"``, which ``fit`` would choose
    again, perhaps on the faster side the plan did not simulate."""
    if paths == ALL_PATHS or not paths:
        return bool(paths)
    return [p for p in PATHS if p in paths]


BATCH_COUNTS = ("val_check_interval", "limit_train_batches", "limit_val_batches", "limit_test_batches")


def rescaled_batch_counts(trainer: dict[str, Any], before: int, after: int) -> list[str]:
    """The Trainer's whole-number counts of batches (``BATCH_COUNTS``; a float is a fraction and stays) rescaled
    in place from micro-batches of ``before`` rows to ``after``, so that validation comes after as many rows, at
    the same optimizer step, and as many rows are validated; a line for each count changed."""
    lines = []
    for key in BATCH_COUNTS:
        count = trainer.get(key)
        if before == after or isinstance(count, bool) or not isinstance(count, int) or count < 1:
            continue
        trainer[key] = max(1, round(count * before / after))
        exact = "" if count * before % after == 0 else f" (rounded from {count * before / after:g})"
        lines.append(
            f"trainer.{key}: {count} -> {trainer[key]}{exact}, as the micro-batch goes from {before} to {after} rows."
        )
    return lines


def _block_names(build: Callable[[], Any], config: TransformConfig) -> list[str] | None:
    """The block classes the plan may checkpoint where the config leaves checkpointing to it
    (``searched_config``): those the (configured) model declares."""
    if config.activation_checkpointing != AUTO:
        return None
    return declared_blocks(configured(build)) or None


def merged_fields(cli_args: list[str]) -> dict[str, Any]:
    """The ``--config`` files (or inline YAML) and ``--key=value`` overrides of ``cli_args`` merged in order, as
    LightningCLI merges them: a later one wins, dicts merge key by key, and a node that names another
    ``class_path`` replaces the earlier one."""
    fields: dict[str, Any] = {}
    for option in options(cli_args):
        if option.name == "--config":
            loaded, _ = read_config(option.value)
            fields = _merge(fields, loaded) if isinstance(loaded, dict) else fields
        elif option.name:
            _set(fields, option.name[2:], yaml.safe_load(option.value))
    return fields


def _merge(base: Any, over: Any) -> Any:
    if not isinstance(base, dict) or not isinstance(over, dict):
        return over
    if "class_path" in over and base.get("class_path") not in (None, over["class_path"]):
        return over
    merged = dict(base)
    for key, value in over.items():
        merged[key] = _merge(base.get(key), value) if key in base else value
    return merged


def _set(fields: dict[str, Any], dotted: str, value: Any) -> None:
    """Set ``a.b.c``; below a ``class_path`` node a key goes into its ``init_args``, as LightningCLI reads
    ``--model.pretrained`` as ``--model.init_args.pretrained``."""
    *parents, last = dotted.split(".")
    node = fields
    for key in parents:
        node = _into_init_args(node, key)
        if not isinstance(node.get(key), dict):
            node[key] = {}
        node = node[key]
    _into_init_args(node, last)[last] = value


def _into_init_args(node: dict[str, Any], key: str) -> dict[str, Any]:
    if "class_path" in node and key not in ("class_path", "init_args", "dict_kwargs"):
        if not isinstance(node.get("init_args"), dict):
            node["init_args"] = {}
        return node["init_args"]
    return node
