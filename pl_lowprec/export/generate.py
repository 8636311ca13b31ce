"""``pl-lowprec generate``: completions of a file of prompts, from a training checkpoint or an exported model.

    pl-lowprec generate --ckpt_path runs/.../last.ckpt --prompts val.jsonl --out completions.jsonl
    pl-lowprec generate --model runs/merged --prompts prompts.txt --out completions.jsonl --do_sample

Prompts: a ``.txt`` file (one prompt per non-empty line) or a ``.jsonl`` file of records with a ``prompt``. Each
output line is ``{"prompt", "completion"}``, plus ``"reference"`` when the input record had a ``completion``.
Decoding is transformers' ``generate``: greedy by default, sampling with ``--do_sample``; it stops at EOS or
after ``--max_new_tokens``. A checkpoint is restored through its config as ``pl-lowprec export`` does (quantized
base and adapters, as trained, under the precision plugin's autocast); ``--model`` takes a merged directory or a
peft adapter directory (its base from ``adapter_config.json``, or ``--base``).
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from pl_lowprec._checks import check_at_least, check_fraction, check_positive, float_in, int_at_least
from pl_lowprec.export.out_paths import prepare_out_file


@dataclass
class Decoding:
    """transformers ``generate`` settings: greedy unless ``do_sample``."""

    max_new_tokens: int = 64
    do_sample: bool = False
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 50
    seed: int = 0

    def __post_init__(self) -> None:
        check_at_least("Decoding", 1, max_new_tokens=self.max_new_tokens)
        check_at_least("Decoding", 0, "0 turns top-k filtering off.", top_k=self.top_k)
        check_positive(
            "Decoding", "1.0 samples from the model's distribution; lower is greedier.", temperature=self.temperature
        )
        check_fraction("Decoding", low_open=True, hint="1.0 keeps every token.", top_p=self.top_p)

    def kwargs(self) -> dict[str, Any]:
        chosen: dict[str, Any] = {"max_new_tokens": self.max_new_tokens, "do_sample": self.do_sample}
        if self.do_sample:
            chosen.update(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k)
        return chosen


@dataclass
class Generator:
    """A Hugging Face causal LM, its tokenizer, and what makes the context each forward runs in."""

    model: Any
    tokenizer: Any
    context: Callable[[], AbstractContextManager] = field(default=nullcontext)

    @torch.no_grad()
    def complete(self, prompts: list[str], decoding: Decoding, batch_size: int = 8) -> list[str]:
        """The completion of each prompt (new tokens only, special tokens dropped), batched with left padding."""
        tokenizer = self.tokenizer
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        device = next(self.model.parameters()).device
        if decoding.do_sample:
            torch.manual_seed(decoding.seed)
        completions: list[str] = []
        was_training = self.model.training
        self.model.eval()
        try:
            for start in range(0, len(prompts), batch_size):
                encoded = [tokenizer(p)["input_ids"] for p in prompts[start : start + batch_size]]
                width = max(len(ids) for ids in encoded)
                input_ids = torch.tensor([[pad] * (width - len(ids)) + ids for ids in encoded], device=device)
                mask = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for ids in encoded], device=device)
                with self.context():
                    out = self.model.generate(
                        input_ids=input_ids,
                        attention_mask=mask,
                        pad_token_id=pad,
                        eos_token_id=tokenizer.eos_token_id,
                        **decoding.kwargs(),
                    )
                completions += tokenizer.batch_decode(out[:, width:], skip_special_tokens=True)
        finally:
            self.model.train(was_training)
        return completions


def read_prompts(path: Path) -> list[dict[str, Any]]:
    """Records with a ``prompt``: one per non-empty line of a ``.txt``, or each line of a ``.jsonl``."""
    if not path.is_file():
        raise FileNotFoundError(f"--prompts {str(path)!r} does not exist.")
    if path.suffix == ".txt":
        return [{"prompt": line} for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    if path.suffix != ".jsonl":
        raise ValueError(f"--prompts {str(path)!r}: give a .txt file (a prompt per line) or a .jsonl file.")
    records = []
    for number, line in _lines(path):
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            raise ValueError(f"{path}:{number}: not valid JSON ({err.msg}).") from err
        if not isinstance(record, dict) or not isinstance(record.get("prompt"), str):
            raise ValueError(f"{path}:{number}: each record needs a string 'prompt'; got {line[:80]!r}.")
        records.append(record)
    if not records:
        raise ValueError(f"--prompts {str(path)!r} holds no prompt.")
    return records


def _lines(path: Path) -> Iterator[tuple[int, str]]:
    with path.open(encoding="utf-8") as handle:
        for number, line in enumerate(handle, start=1):
            if line.strip():
                yield number, line


def write_completions(records: list[dict[str, Any]], completions: list[str], out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("w", encoding="utf-8") as handle:
        for record, completion in zip(records, completions, strict=True):
            row = {"prompt": record["prompt"], "completion": completion}
            if isinstance(record.get("completion"), str):
                row["reference"] = record["completion"]
            handle.write(json.dumps(row) + "\n")


def from_checkpoint(checkpoint: str | Path, cli_args: list[str], tokenizer: str | None = None) -> Generator:
    """The trained module as it trained (quantized base, adapters), restored from its config."""
    from pl_lowprec.data.text import load_tokenizer
    from pl_lowprec.export.command import pretrained_dir
    from pl_lowprec.export.restore import restore

    restored = restore(checkpoint, cli_args)
    model = restored.hf_model
    if model is None:
        raise ValueError(
            f"{type(restored.module).__name__} holds no Hugging Face model with generate(); pl-lowprec generate needs"
            " one (pl_lowprec.models.CausalLM, or a module with a PreTrainedModel attribute)."
        )
    source = tokenizer or restored.tokenizer_dir or pretrained_dir(restored)
    if source is None:
        raise ValueError("No tokenizer: the config names no data tokenizer or model directory; pass --tokenizer DIR.")
    return Generator(model, load_tokenizer(source), restored.trainer.precision_plugin.forward_context)


def from_directory(directory: str | Path, base: str | None = None, device: str = "auto") -> Generator:
    """A merged model directory, or a peft adapter directory on its base model."""
    from transformers import AutoModelForCausalLM

    from pl_lowprec.data.text import load_tokenizer

    path = Path(directory)
    if not path.is_dir():
        raise FileNotFoundError(f"--model {str(path)!r} is not a directory (an exported model or adapter).")
    target = torch.device(
        "cuda" if device == "auto" and torch.cuda.is_available() else "cpu" if device == "auto" else device
    )
    adapter_config = path / "adapter_config.json"
    if adapter_config.is_file():
        from pl_lowprec._imports import import_peft

        peft = import_peft()
        base = base or json.loads(adapter_config.read_text()).get("base_model_name_or_path")
        if not base:
            raise ValueError(f"{adapter_config} names no base_model_name_or_path: pass --base MODEL_DIR.")
        model = peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), str(path))
    elif (path / "config.json").is_file():
        model = AutoModelForCausalLM.from_pretrained(str(path))
    else:
        raise ValueError(f"--model {str(path)!r} holds neither config.json (a merged model) nor adapter_config.json.")
    tokenizer_source = path if (path / "tokenizer_config.json").is_file() else base
    return Generator(model.to(target), load_tokenizer(tokenizer_source or path))


def main(args: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="pl-lowprec generate", description=__doc__.split("\n\n")[0])
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--ckpt_path", help="A training checkpoint (with --config, or its run's config.yaml).")
    source.add_argument("--model", help="An exported directory: merged model, or peft adapter.")
    parser.add_argument("--prompts", required=True, help=".txt (a prompt per line) or .jsonl with 'prompt'.")
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
    parsed, cli_args = parser.parse_known_args(args)
    decoding = Decoding(
        parsed.max_new_tokens, parsed.do_sample, parsed.temperature, parsed.top_p, parsed.top_k, parsed.seed
    )
    records = read_prompts(Path(parsed.prompts))
    inputs = {"prompts file": Path(parsed.prompts), "tokenizer": parsed.tokenizer and Path(parsed.tokenizer)}
    if parsed.ckpt_path is not None:
        from pl_lowprec.cli.resume import check_checkpoint
        from pl_lowprec.export.command import config_files, with_config
        from pl_lowprec.export.restore import ConfigClassError

        check_checkpoint(Path(parsed.ckpt_path))
        cli_args = with_config(Path(parsed.ckpt_path), cli_args, parser)
        inputs |= {"checkpoint": Path(parsed.ckpt_path), **config_files(cli_args)}
        prepare_out_file(Path(parsed.out), parsed.overwrite, inputs)
        try:
            generator = from_checkpoint(parsed.ckpt_path, cli_args, parsed.tokenizer)
        except ConfigClassError as err:
            parser.exit(2, f"{parser.prog}: error: {err}\n")
    else:
        if cli_args:
            parser.error(f"unrecognized arguments: {' '.join(cli_args)} (config overrides go with --ckpt_path)")
        inputs |= {"model directory": Path(parsed.model), "base model": parsed.base and Path(parsed.base)}
        prepare_out_file(Path(parsed.out), parsed.overwrite, inputs)
        generator = from_directory(parsed.model, parsed.base, parsed.device)
        if parsed.tokenizer:
            from pl_lowprec.data.text import load_tokenizer

            generator.tokenizer = load_tokenizer(parsed.tokenizer)
    completions = generator.complete([r["prompt"] for r in records], decoding, parsed.batch_size)
    write_completions(records, completions, Path(parsed.out))
    print(f"Wrote {len(completions)} completions to {parsed.out}.")
