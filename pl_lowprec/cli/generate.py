"""``pl-lowprec generate``: completions of a file of prompts, from a training checkpoint or an exported model.

    pl-lowprec generate --ckpt_path runs/.../last.ckpt --prompts val.jsonl --out completions.jsonl
    pl-lowprec generate --model runs/merged --prompts prompts.txt --out completions.jsonl --do_sample
    pl-lowprec generate --model runs/chat --prompts questions.txt --out answers.jsonl --chat

A checkpoint is restored through its config as ``pl-lowprec export`` does (``pl_lowprec.cli.rebuild``); see
``pl_lowprec.export.generate`` for the prompt files, the decoding and the output lines.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

from pl_lowprec._checks import float_in, int_at_least
from pl_lowprec.adapters import held_hf_model
from pl_lowprec.cli.rebuild import config_files, rebuild, with_config
from pl_lowprec.cli.resume import check_checkpoint
from pl_lowprec.cli.subcommands import description, examples
from pl_lowprec.export.generate import (
    Decoding,
    Generator,
    check_chat_template,
    check_model_dir,
    directory_tokenizer,
    from_directory,
    from_restored,
    read_prompts,
    wants_chat,
    write_completions,
)
from pl_lowprec.export.generates_text import check_module_generates
from pl_lowprec.export.out_paths import prepare_out_file
from pl_lowprec.export.restore import restore
from pl_lowprec.loading.tokenizer import load_tokenizer


def json_object(text: str) -> dict:
    """An argparse type: a JSON object (``{"enable_thinking": false}``)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as err:
        raise argparse.ArgumentTypeError(f"{text!r} is not JSON ({err.msg}); give an object") from err
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"{text!r} is not a JSON object: give '{{\"name\": value}}'")
    return value


def from_checkpoint(
    checkpoint: str | Path, cli_args: list[str], tokenizer: str | None = None, chat: bool = False
) -> Generator:
    """The trained module as it trained (quantized base, adapters), restored from its config. With ``chat``, a
    tokenizer known from the arguments or the config's data is checked for a template before the weights load."""
    run = rebuild(cli_args)
    # a model built in __init__ is known before the weights load
    check_module_generates(held_hf_model(run.model), type(run.model).__name__)
    source = tokenizer or getattr(run.datamodule, "tokenizer_dir", None)
    if chat and source:
        check_chat_template(load_tokenizer(source), source)
    return from_restored(restore(checkpoint, run.trainer, run.model, run.datamodule), tokenizer)


def main(args: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="pl-lowprec generate",
        description=description("generate"),
        epilog=examples(__doc__),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--ckpt_path", help="A training checkpoint (with --config, or its run's config.yaml).")
    source.add_argument("--model", help="An exported directory: merged model, or peft adapter.")
    parser.add_argument(
        "--prompts", required=True, help=".txt (a prompt per line) or .jsonl with 'prompt' or 'messages'."
    )
    parser.add_argument("--chat", action="store_true", help="Send each plain prompt as a user turn (chat template).")
    parser.add_argument("--out", required=True, help="The .jsonl file to write (a new one, or --overwrite).")
    parser.add_argument("--overwrite", action="store_true", help="Replace an existing --out (never a file read).")
    parser.add_argument("--base", help="Base model directory for an adapter (default: from adapter_config.json).")
    parser.add_argument("--tokenizer", help="Tokenizer directory (default: the model's or the config's).")
    parser.add_argument("--device", default="auto", help="For --model: cuda if available, else cpu.")
    parser.add_argument("--batch_size", type=int_at_least(1), default=8)
    parser.add_argument("--max_new_tokens", type=int_at_least(1), default=64)
    parser.add_argument("--do_sample", action="store_true", help="Sample instead of greedy decoding.")
    parser.add_argument("--temperature", type=float_in(0, math.inf), default=1.0, help="With --do_sample.")
    parser.add_argument("--top_p", type=float_in(0, 1), default=1.0, help="With --do_sample (1.0: no filter).")
    parser.add_argument("--top_k", type=int_at_least(0), default=50, help="With --do_sample (0: no filter).")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--chat_template_kwargs",
        type=json_object,
        help="The chat template's arguments for every chat prompt, as JSON: '{\"enable_thinking\": false}'"
        " (default: the run's data chat_template_kwargs); a record's own take precedence.",
    )
    parsed, cli_args = parser.parse_known_args(args)
    decoding = Decoding(
        parsed.max_new_tokens, parsed.do_sample, parsed.temperature, parsed.top_p, parsed.top_k, parsed.seed
    )
    records = read_prompts(Path(parsed.prompts), parsed.chat)
    chat = wants_chat(records)
    inputs = {"prompts file": Path(parsed.prompts), "tokenizer": parsed.tokenizer and Path(parsed.tokenizer)}
    if parsed.ckpt_path is not None:
        check_checkpoint(Path(parsed.ckpt_path))
        cli_args = with_config(Path(parsed.ckpt_path), cli_args, parser)
        inputs |= {"checkpoint": Path(parsed.ckpt_path), **config_files(cli_args)}
        prepare_out_file(Path(parsed.out), parsed.overwrite, inputs)
        generator = from_checkpoint(parsed.ckpt_path, cli_args, parsed.tokenizer, chat)
    else:
        if cli_args:
            parser.error(f"unrecognized arguments: {' '.join(cli_args)} (config overrides go with --ckpt_path)")
        inputs |= {"model directory": Path(parsed.model), "base model": parsed.base and Path(parsed.base)}
        check_model_dir(Path(parsed.model))
        prepare_out_file(Path(parsed.out), parsed.overwrite, inputs)
        source = parsed.tokenizer or directory_tokenizer(parsed.model, parsed.base)
        tokenizer = load_tokenizer(source)
        if chat:
            check_chat_template(tokenizer, source)  # before the model loads
        generator = from_directory(parsed.model, parsed.base, parsed.device, tokenizer)
    if chat:
        check_chat_template(generator.tokenizer, parsed.tokenizer)
    if parsed.chat_template_kwargs is not None:
        generator.template_kwargs = parsed.chat_template_kwargs
    completions = generator.complete_records(records, decoding, parsed.batch_size)
    write_completions(records, completions, Path(parsed.out))
    print(f"Wrote {len(completions)} completions to {parsed.out}.")
