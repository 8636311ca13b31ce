"""``pl-lowprec generate``: completions of a file of prompts, from a training checkpoint or an exported model.

    pl-lowprec generate --ckpt_path runs/.../last.ckpt --prompts val.jsonl --out completions.jsonl
    pl-lowprec generate --model runs/merged --prompts prompts.txt --out completions.jsonl --do_sample
    pl-lowprec generate --model runs/chat --prompts questions.txt --out answers.jsonl --chat
    pl-lowprec generate --model runs/merged --prompts data/test.parquet --fields '{prompt: question}' --out a.jsonl
    pl-lowprec generate --model Qwen/Qwen2.5-0.5B-Instruct --prompts val.jsonl --out before.jsonl

A checkpoint is restored through its config as ``pl-lowprec export`` does (``pl_lowprec.cli.rebuild``), and its
run's data ``fields`` and ``val_split`` read the prompts unless ``--fields`` and ``--split`` say otherwise; see
``pl_lowprec.export.prompt_files`` for the prompts and ``pl_lowprec.export.generate`` for the decoding and the output
lines.
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from pl_lowprec._checks import float_in, int_at_least
from pl_lowprec.adapters import held_hf_model
from pl_lowprec.cli.lightning_cli import LowPrecisionCLI
from pl_lowprec.cli.own_options import check_own_options
from pl_lowprec.cli.rebuild import config_files, rebuild, with_config
from pl_lowprec.cli.resume import check_checkpoint
from pl_lowprec.cli.subcommands import subcommand_parser
from pl_lowprec.data.split_options import check_split
from pl_lowprec.data.text import VAL_SPLITS
from pl_lowprec.export.generate import (
    Decoding,
    Generator,
    adapter_base,
    check_generation_dtype,
    check_model_dir,
    checked_prompt_ids,
    directory_tokenizer,
    from_directory,
    from_restored,
    generation_device,
    model_location,
    model_tokenizer,
    wants_chat,
    write_completions,
)
from pl_lowprec.export.generates_text import check_module_generates
from pl_lowprec.export.out_paths import prepare_out_file
from pl_lowprec.export.prompt_files import (
    check_prompt_fields,
    prompt_fields_of_run,
    prompt_sources,
    read_prompts,
)
from pl_lowprec.export.restore import restore
from pl_lowprec.loading.tokenizer import load_tokenizer


def mapping(example: str) -> Callable[[str], dict]:
    """An argparse type: a mapping in JSON (``'{"enable_thinking": false}'``), else in YAML (``'{prompt:
    question}'``, as LightningCLI's overrides read); JSON first, where PyYAML would read ``1e-5`` as a string. A
    refusal shows ``example``."""

    def parse(text: str) -> dict:
        try:
            value = json.loads(text)
        except json.JSONDecodeError:
            value = None
        try:
            value = yaml.safe_load(text) if value is None else value
        except yaml.YAMLError as err:
            raise argparse.ArgumentTypeError(f"{text!r} is not YAML or JSON ({str(err).splitlines()[0]})") from err
        if not isinstance(value, dict):
            raise argparse.ArgumentTypeError(f"{text!r} is not a mapping: give {example}")
        return value

    return parse


def from_checkpoint(checkpoint: str | Path, cli_args: list[str], tokenizer: str | None = None) -> Generator:
    """The trained module as it trained (quantized base, adapters), restored from its config."""
    return from_run(checkpoint, rebuild(cli_args), tokenizer)


def prompt_settings(
    data: object | None, fields: dict[str, str] | None, split: str | None
) -> tuple[dict[str, str] | None, tuple[str, ...]]:
    """``--fields`` and ``--split``, else those of the run's data module (``data``, from a checkpoint): its
    held-out file's columns are read as it trained on them. Said in one line where the run's fields apply."""
    if fields is None and data is not None:
        fields = prompt_fields_of_run(getattr(data, "fields", None))
        if fields is not None:
            print(f"Reading --prompts with the run's data fields {fields} (--fields to read other columns).")
    splits = (split,) if split else tuple(getattr(data, "val_splits", VAL_SPLITS))
    return fields, splits


def from_run(checkpoint: str | Path, run: LowPrecisionCLI, tokenizer: str | None = None) -> Generator:
    """``from_checkpoint`` of a run already rebuilt."""
    # a model built in __init__ is known before the weights load
    check_module_generates(held_hf_model(run.model), type(run.model).__name__)
    restored = restore(checkpoint, run.trainer, run.model, run.datamodule, merge=False)  # no original keys written
    return from_restored(restored, tokenizer)


def tokenized_prompts(
    tokenizer: Any, source: str | Path | None, records: list[dict], given: dict | None, of_run: dict | None
) -> list[list[int]]:
    """``checked_prompt_ids`` under the chat template's arguments for every prompt: ``--chat_template_kwargs``
    (``given``) else the run's data's (``of_run``), each named in a refusal as the user gave it."""
    if given is not None:
        kwargs, named = given, f"--chat_template_kwargs '{json.dumps(given)}'"
    else:
        kwargs = dict(of_run or {})
        named = f"the run's data chat_template_kwargs {kwargs!r} (--chat_template_kwargs gives others)"
    return checked_prompt_ids(tokenizer, source, records, kwargs, named)


def main(args: list[str] | None = None) -> None:
    parser = subcommand_parser("generate", __doc__)
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--ckpt_path", help="A training checkpoint (with --config, or its run's config.yaml).")
    source.add_argument(
        "--model",
        help="An exported directory (merged model, or peft adapter), a hub id of either (downloaded: the base model's"
        " completions before fine-tuning), or a .gguf file (read by transformers, dequantized: what a quantized"
        " export keeps of the fine-tune).",
    )
    parser.add_argument(
        "--prompts",
        required=True,
        help=".txt (a prompt per line); or records as the training data reads them: .jsonl, .parquet, .csv, .json,"
        " .arrow, a saved dataset or a hub id, with 'prompt' (and 'completion', the reference), 'messages',"
        " ShareGPT or alpaca fields.",
    )
    parser.add_argument(
        "--fields",
        type=mapping("'{prompt: question, completion: answer}'"),
        help="Your column names: '{prompt: question, completion: answer}' or '{messages: chat}' (default with"
        " --ckpt_path: the run's data fields).",
    )
    parser.add_argument(
        "--split", help="The split of a dataset dict (default: the run's val_split; else validation, else test)."
    )
    parser.add_argument("--limit", type=int_at_least(1), help="Complete only the first N prompts.")
    parser.add_argument("--chat", action="store_true", help="Send each plain prompt as a user turn (chat template).")
    parser.add_argument("--out", required=True, help="The .jsonl file to write (a new one, or --overwrite).")
    parser.add_argument("--overwrite", action="store_true", help="Replace an existing --out (never a file read).")
    parser.add_argument("--base", help="Base model directory for an adapter (default: from adapter_config.json).")
    parser.add_argument("--tokenizer", help="Tokenizer directory (default: the model's or the config's).")
    parser.add_argument("--device", default="auto", help="For --model: cuda if available, else cpu.")
    parser.add_argument(
        "--dtype",
        help="For --model: float32 (the default, as a GGUF file is read, so every form of an export computes alike),"
        " bfloat16 or float16 (half the memory on a GPU). A checkpoint runs as it trained, under its precision.",
    )
    parser.add_argument("--batch_size", type=int_at_least(1), default=8)
    parser.add_argument("--max_new_tokens", type=int_at_least(1), default=64)
    parser.add_argument("--do_sample", action="store_true", help="Sample instead of greedy decoding.")
    from_model = "default: the model's generation_config, as transformers' generate takes it"
    parser.add_argument("--temperature", type=float_in(0, math.inf), help=f"With --do_sample ({from_model}).")
    parser.add_argument("--top_p", type=float_in(0, 1), help=f"With --do_sample (1.0: no filter; {from_model}).")
    parser.add_argument("--top_k", type=int_at_least(0), help=f"With --do_sample (0: no filter; {from_model}).")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--chat_template_kwargs",
        type=mapping("'{\"enable_thinking\": false}'"),
        help="The chat template's arguments for every chat prompt, as JSON: '{\"enable_thinking\": false}'"
        " (default: the run's data chat_template_kwargs); a record's own take precedence.",
    )
    parsed, cli_args = parser.parse_known_args(args)
    check_own_options(parser, cli_args, takes_overrides=parsed.ckpt_path is not None)
    decoding = Decoding(
        parsed.max_new_tokens, parsed.do_sample, parsed.temperature, parsed.top_p, parsed.top_k, parsed.seed
    )
    fields = check_prompt_fields(parsed.fields)
    sources = prompt_sources(parsed.prompts)  # it exists and is read: before anything else loads
    check_split("--split", parsed.split, sources, "--prompts")  # a file has none: it was read whole, unsaid
    inputs = {"prompts file": Path(parsed.prompts), "tokenizer": parsed.tokenizer and Path(parsed.tokenizer)}
    if parsed.ckpt_path is not None and parsed.dtype is not None:
        raise ValueError(
            f"--dtype {parsed.dtype} applies to --model: a checkpoint runs as it trained, its quantized base and"
            " adapters under the config's precision plugin. Leave --dtype out, or export the checkpoint"
            " (pl-lowprec export --merged) and generate from that with --model and --dtype."
        )
    dtype = parsed.dtype or "float32"
    if parsed.ckpt_path is None:
        check_generation_dtype(dtype)  # before anything loads
    prompt_ids: list[list[int]] | None = None  # tokenized once: before the model loads where that can be
    if parsed.ckpt_path is not None:
        check_checkpoint(Path(parsed.ckpt_path))
        cli_args = with_config(Path(parsed.ckpt_path), cli_args, parser)
        inputs |= {"checkpoint": Path(parsed.ckpt_path), **config_files(cli_args)}
        prepare_out_file(Path(parsed.out), parsed.overwrite, inputs)
        run = rebuild(cli_args)
        settings = prompt_settings(run.datamodule, fields, parsed.split)
        records = read_prompts(sources, parsed.chat, *settings, parsed.limit)
        chat = wants_chat(records)
        source = parsed.tokenizer or getattr(run.datamodule, "tokenizer_dir", None)
        if chat and source:  # before the checkpoint's weights load
            of_run = getattr(run.datamodule, "chat_template_kwargs", None)
            prompt_ids = tokenized_prompts(load_tokenizer(source), source, records, parsed.chat_template_kwargs, of_run)
        generator = from_run(parsed.ckpt_path, run, parsed.tokenizer)
    else:
        inputs |= {"model directory": Path(parsed.model), "base model": parsed.base and Path(parsed.base)}
        device = generation_device(parsed.device)
        prepare_out_file(Path(parsed.out), parsed.overwrite, inputs)  # before a hub id downloads
        model = model_location(parsed.model)
        check_model_dir(model)
        base = adapter_base(model, parsed.base)
        settings = prompt_settings(None, fields, parsed.split)
        records = read_prompts(sources, parsed.chat, *settings, parsed.limit)
        chat = wants_chat(records)
        source = parsed.tokenizer or directory_tokenizer(model, base)
        tokenizer = model_tokenizer(source)
        if chat:  # before the model loads
            prompt_ids = tokenized_prompts(tokenizer, source, records, parsed.chat_template_kwargs, None)
        generator = from_directory(model, base, device, tokenizer, dtype)
        print(f"Generating with --model {parsed.model} in {dtype} (--dtype).")
    if prompt_ids is None:  # a checkpoint whose tokenizer was known only once it was restored
        prompt_ids = tokenized_prompts(
            generator.tokenizer, parsed.tokenizer, records, parsed.chat_template_kwargs, generator.template_kwargs
        )
    sampling = decoding.sampling_line(generator.model)
    if sampling is not None:
        print(sampling)
    completions = generator.complete_ids(prompt_ids, decoding, parsed.batch_size)
    print(write_completions(records, completions, Path(parsed.out)))
