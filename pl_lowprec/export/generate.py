"""Completions of a file of prompts (``pl-lowprec generate``), from a restored checkpoint or an exported model.

    pl-lowprec generate --ckpt_path runs/.../last.ckpt --prompts val.jsonl --out completions.jsonl
    pl-lowprec generate --model runs/merged --prompts prompts.txt --out completions.jsonl --do_sample

Prompts (``pl_lowprec.export.prompt_files``): a ``.txt`` file (one prompt per non-empty line), or records as
``TextDataModule`` reads them (``.jsonl``, Parquet, CSV, JSON, Arrow, saved datasets; ``fields`` for other column
names) with a ``prompt`` (a string, or TRL's list of turns), ``messages``, ShareGPT or alpaca turns. A ``messages``
record is rendered with the tokenizer's chat template and its generation prompt, as ``TextDataModule`` renders it
for training (a trailing assistant turn is left out and becomes the reference); ``chat=True`` (``--chat``) wraps
each plain prompt as one user turn. Each output line is ``{"prompt", "completion"}`` (``{"messages", "completion"}``
for a chat record), plus ``"reference"`` when the input record had a ``completion`` or a last assistant turn.
Decoding is transformers' ``generate``: greedy by default, sampling with ``--do_sample``; it stops at the model's
``generation_config`` EOS ids, the tokenizer's EOS or the chat template's end of turn (``stop_tokens``), or after
``--max_new_tokens``. A checkpoint is restored through its config as ``pl-lowprec export`` does (quantized
base and adapters, as trained, under the precision plugin's autocast); ``--model`` takes a merged directory, a
peft adapter directory (its base from ``adapter_config.json``, or ``--base``), a hub id of either (downloaded) or a
GGUF file (``gguf_read``).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from pl_lowprec._checks import check_at_least, check_fraction, check_positive
from pl_lowprec._imports import import_peft
from pl_lowprec.adapters import mismatch_summary, recorded_base
from pl_lowprec.data.chat import ChatTemplate, TemplateFieldError, UnusableChatRecord
from pl_lowprec.data.template_arguments import check_template_arguments
from pl_lowprec.export.generates_text import check_directory_generates, check_module_generates
from pl_lowprec.export.gguf_read import check_gguf_file, gguf_model, gguf_tokenizer, is_gguf, starts_as_gguf
from pl_lowprec.export.prompt_files import chat_turns
from pl_lowprec.export.restore import Restored
from pl_lowprec.export.stop_tokens import stop_token_ids
from pl_lowprec.export.write import pretrained_dir
from pl_lowprec.loading.generation_config import generation_default, load_generation_config
from pl_lowprec.loading.hub import is_hub_id, local_or_downloaded, resolve_pretrained
from pl_lowprec.loading.tokenizer import load_tokenizer

SAMPLING = ("temperature", "top_p", "top_k")
TRANSFORMERS_SAMPLING = {"temperature": 1.0, "top_p": 1.0, "top_k": 50}  # generate's where generation_config has none


@dataclass
class Decoding:
    """transformers ``generate`` settings: greedy unless ``do_sample``. A sampling setting left ``None`` is the
    model's ``generation_config``'s, as ``model.generate(do_sample=True)`` takes it (Llama-3.x-Instruct: temperature
    0.6, top_p 0.9; Qwen2.5-Instruct: 0.7, 0.8, top_k 20); it was 1.0, 1.0 and 50 whatever the model said."""

    max_new_tokens: int = 64
    do_sample: bool = False
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        check_at_least("Decoding", 1, max_new_tokens=self.max_new_tokens)
        if self.top_k is not None:
            check_at_least("Decoding", 0, "0 turns top-k filtering off.", top_k=self.top_k)
        if self.temperature is not None:
            hint = "1.0 samples from the model's distribution; lower is greedier."
            check_positive("Decoding", hint, temperature=self.temperature)
        if self.top_p is not None:
            check_fraction("Decoding", low_open=True, hint="1.0 keeps every token.", top_p=self.top_p)
        sampling = self.given_sampling()
        if sampling and not self.do_sample:  # transformers' generate would decode greedily, ignoring them
            given = ", ".join(f"{k}={v}" for k, v in sampling.items())
            raise ValueError(
                f"{given} {'sets' if len(sampling) == 1 else 'set'} sampling, and do_sample is off: greedy decoding"
                " would ignore it. Add --do_sample (do_sample=True) to sample, or leave it out for greedy completions."
            )

    def given_sampling(self) -> dict[str, float | int]:
        """The sampling settings given here; the others are the model's ``generation_config``'s."""
        return {k: getattr(self, k) for k in SAMPLING if getattr(self, k) is not None}

    def kwargs(self) -> dict[str, Any]:
        chosen: dict[str, Any] = {"max_new_tokens": self.max_new_tokens, "do_sample": self.do_sample}
        if self.do_sample:
            chosen.update(self.given_sampling())
        return chosen

    def sampling_line(self, model: Any) -> str | None:
        """What sampling runs with, and where each value came from; ``None`` for greedy decoding."""
        if not self.do_sample:
            return None
        given = self.given_sampling()
        parts = []
        for name in SAMPLING:
            configured = generation_default(model, name)
            if name in given:
                parts.append(f"{name} {given[name]}")
            elif configured is not None:
                parts.append(f"{name} {configured} (the model's generation_config)")
            else:
                parts.append(f"{name} {TRANSFORMERS_SAMPLING[name]} (transformers' default)")
        return f"Sampling with {', '.join(parts)}, seed {self.seed}."


@dataclass
class Generator:
    """A Hugging Face causal LM, its tokenizer, and what makes the context each forward runs in."""

    model: Any
    tokenizer: Any
    context: Callable[[], AbstractContextManager] = field(default=nullcontext)
    template_kwargs: dict[str, Any] = field(default_factory=dict)  # the chat template's, under a record's own

    def complete(self, prompts: list[str], decoding: Decoding, batch_size: int = 8) -> list[str]:
        """The completion of each prompt text (tokenized as the tokenizer does by default, BOS included)."""
        return self.complete_ids([self.tokenizer(p)["input_ids"] for p in prompts], decoding, batch_size)

    @torch.no_grad()
    def complete_ids(self, prompts: list[list[int]], decoding: Decoding, batch_size: int = 8) -> list[str]:
        """The completion of each prompt (new tokens only, special tokens dropped), batched with left padding."""
        tokenizer = self.tokenizer
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        device = next(self.model.parameters()).device
        stops = stop_token_ids(self.model, tokenizer)
        if decoding.do_sample:
            torch.manual_seed(decoding.seed)
        completions: list[str] = []
        was_training = self.model.training
        self.model.eval()
        try:
            for start in range(0, len(prompts), batch_size):
                encoded = prompts[start : start + batch_size]
                width = max(len(ids) for ids in encoded)
                input_ids = torch.tensor([[pad] * (width - len(ids)) + ids for ids in encoded], device=device)
                mask = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for ids in encoded], device=device)
                with self.context():
                    out = self.model.generate(
                        input_ids=input_ids,
                        attention_mask=mask,
                        pad_token_id=pad,
                        eos_token_id=stops,
                        **decoding.kwargs(),
                    )
                completions += tokenizer.batch_decode(out[:, width:], skip_special_tokens=True)
        finally:
            self.model.train(was_training)
        return completions


def reference(record: dict[str, Any]) -> str | None:
    """The expected completion: a chat record's last assistant turn, else a plain record's ``completion``."""
    if "messages" in record and record["messages"] and record["messages"][-1]["role"] == "assistant":
        return record["messages"][-1].get("content")
    completion = record.get("completion")
    return completion if isinstance(completion, str) else None


def wants_chat(records: list[dict[str, Any]]) -> bool:
    return any("messages" in r for r in records)


def tokenizer_name(tokenizer: Any, source: str | Path | None) -> str:
    """How a refusal names the tokenizer: where it was read from, else its own name."""
    return str(source) if source is not None else getattr(tokenizer, "name_or_path", "?")


def check_chat_template(tokenizer: Any, source: str | Path | None) -> None:
    """Chat prompts need a template; rendering them as plain text would not be what a chat model trained on."""
    if not getattr(tokenizer, "chat_template", None):
        name = tokenizer_name(tokenizer, source)
        raise ValueError(
            f"Chat prompts ('messages' records or --chat) need the tokenizer's chat template, and the tokenizer"
            f" {name!r} has none (no chat_template.jinja beside it, no chat_template in its tokenizer_config.json)."
            " Pass --tokenizer DIR with a chat model's tokenizer, or give plain 'prompt' records without --chat."
        )


def checked_prompt_ids(
    tokenizer: Any,
    source: str | Path | None,
    records: list[dict[str, Any]],
    template_kwargs: dict[str, Any],
    given: str,
) -> list[list[int]]:
    """``all_prompt_ids`` after the checks of the tokenizer alone: a chat template (``check_chat_template``) that
    reads every one of ``template_kwargs`` (named ``given`` in the refusal). Needs no model: run before it loads."""
    if wants_chat(records):
        check_chat_template(tokenizer, source)
        check_template_arguments(tokenizer, template_kwargs, tokenizer_name(tokenizer, source), given)
    return all_prompt_ids(tokenizer, records, template_kwargs)


def prompt_ids(tokenizer: Any, record: dict[str, Any], template_kwargs: dict[str, Any] | None = None) -> list[int]:
    """A chat record rendered as ``TextDataModule`` renders it (template, no extra special tokens) plus the
    generation prompt, checked as its records are (``ChatTemplate.check_turns``: roles the template knows, every
    turn and tool written, arguments read); a plain prompt tokenized with the tokenizer's defaults."""
    if "messages" not in record:
        return tokenizer(record["prompt"])["input_ids"]
    return ChatTemplate.for_record(tokenizer, record, template_kwargs).prompt_ids(chat_turns(record))


def all_prompt_ids(tokenizer: Any, records: list[dict[str, Any]], template_kwargs: dict[str, Any]) -> list[list[int]]:
    """Each record's ``prompt_ids``; a record the chat template refuses (Gemma's has no system role), whose
    ``tools`` or ``chat_template_kwargs`` it cannot take, or that training would count unusable (a role the
    template does not know, a turn it drops), refused by its place among the prompts, before any generates (a
    traceback from jinja2 named neither)."""
    ids = []
    for number, record in enumerate(records, start=1):
        try:
            ids.append(prompt_ids(tokenizer, record, template_kwargs))
        except UnusableChatRecord as refused:
            turn = chat_turns(record)[0].get("content", "") if chat_turns(record) else ""
            reason = str(refused).removeprefix("records ")
            reason = f"a record {reason}" if reason.startswith(("with ", "whose ", "starting ")) else reason
            raise ValueError(
                f"--prompts record {number} (first turn {str(turn)[:40]!r}): {reason}."
                " Fix the record, or pass --tokenizer DIR with a template that takes it."
            ) from None
        except TemplateFieldError as problem:
            raise ValueError(f"--prompts record {number}: {problem}") from None
    return ids


def write_completions(records: list[dict[str, Any]], completions: list[str], out: Path) -> str:
    """Write the rows; return the summary line, with how many completions equal their reference, where the
    prompts had one (a quick check of a fine-tune, and of what a quantized export keeps of it), and how many are
    empty (an empty file of completions says nothing by itself)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    references = equal = 0
    empty = sum(not completion.strip() for completion in completions)
    with out.open("w", encoding="utf-8") as handle:
        for record, completion in zip(records, completions, strict=True):
            row = {"prompt": record["prompt"]} if "prompt" in record else {"messages": chat_turns(record)}
            row["completion"] = completion
            expected = reference(record)
            if expected is not None:
                row["reference"] = expected
                references += 1
                equal += completion == expected
            handle.write(json.dumps(row) + "\n")
    same = f" ({equal} of {references} equal to their reference)" if references else ""
    blank = (
        f" {empty} of {len(completions)} are empty: the model ended them at once (an end-of-sequence token first:"
        " check the chat template and the EOS the fine-tune learned) or wrote only tokens the tokenizer decodes to"
        " nothing (a tokenizer that is not the model's)."
        if empty
        else ""
    )
    return f"Wrote {len(completions)} completions to {out}{same}.{blank}"


def from_restored(restored: Restored, tokenizer: str | None = None) -> Generator:
    """The trained module as it trained (quantized base, adapters), under the precision plugin's autocast."""
    model = restored.hf_model
    if model is None:
        raise ValueError(
            f"{type(restored.module).__name__} holds no Hugging Face model with generate(); pl-lowprec generate needs"
            " one (pl_lowprec.models.CausalLM, or a module with a PreTrainedModel attribute)."
        )
    check_module_generates(model, type(restored.module).__name__)
    load_generation_config(model, pretrained_dir(restored))  # a module of the user's built from_config: the files'
    source = tokenizer or restored.tokenizer_dir or pretrained_dir(restored)
    if source is None:
        raise ValueError("No tokenizer: the config names no data tokenizer or model directory; pass --tokenizer DIR.")
    context = restored.trainer.precision_plugin.forward_context
    return Generator(model, load_tokenizer(source), context, dict(restored.chat_template_kwargs))


def directory_tokenizer(directory: str | Path, base: str | Path | None = None) -> str | Path:
    """Where ``from_directory`` takes the tokenizer: the directory if it holds one, else the (adapter's) base; a
    GGUF file's own."""
    path = Path(directory)
    if is_gguf(path):
        return path
    if (path / "tokenizer_config.json").is_file():
        return path
    return base or recorded_base(path) or path


def model_tokenizer(source: str | Path) -> Any:
    """The tokenizer of ``directory_tokenizer``'s answer (or ``--tokenizer``): a directory's, or a GGUF file's."""
    return gguf_tokenizer(Path(source)) if is_gguf(source) else load_tokenizer(source)


def generation_device(device: str | torch.device = "auto") -> torch.device:
    """``--device``: ``auto`` (cuda if available, else cpu), or a device this machine has; ``ValueError`` naming
    the choices otherwise, before anything loads."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        chosen = torch.device(device)
    except RuntimeError as err:
        raise ValueError(f"--device {str(device)!r} is not a device: give auto, cpu, cuda or cuda:N.") from err
    if chosen.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0 or (chosen.index or 0) >= count:
            has = f"{count} CUDA GPU(s)" if count else "no CUDA GPU"
            raise ValueError(f"--device {str(device)!r}: this machine has {has}. Use --device auto or cpu.")
    return chosen


def model_location(model: str) -> Path:
    """``--model``: a local directory or GGUF file as it is; a hub id (``org/name``: a model or a peft adapter)
    downloaded where there is network, as ``CausalLM(pretrained=...)`` downloads it."""
    return local_or_downloaded(model) if is_hub_id(model) and not is_gguf(model) else Path(model)


def adapter_base(directory: Path, base: str | Path | None = None) -> Path | None:
    """A peft adapter directory's base model: ``base`` (``--base``) or its ``adapter_config.json``'s, a directory
    or a hub id downloaded; None for anything else. Checked before any weights load."""
    adapter_config = directory / "adapter_config.json"
    if is_gguf(directory) or not adapter_config.is_file():
        return None
    named = base or recorded_base(directory)
    if not named:
        raise ValueError(f"{adapter_config} names no base_model_name_or_path: pass --base MODEL_DIR.")
    try:
        return resolve_pretrained(named)
    except ValueError as err:  # its advice, worded for --base
        if base is not None:
            raise ValueError(str(err).replace("pretrained=", "--base ")) from err
        said = str(err).replace("pass pretrained=", "pass --base ").replace("pretrained=", "")
        said += "" if "--base" in said else " Or pass the base model as --base DIR."
        raise ValueError(f"The adapter's base model, {adapter_config}'s base_model_name_or_path: {said}") from err


def check_model_dir(path: Path) -> None:
    """``--model``: a directory that an export wrote (a merged model or a peft adapter), or a GGUF file."""
    if is_gguf(path):
        check_gguf_file(path)
        return
    if not path.is_dir():
        what = "does not exist" if not path.exists() else "is a file"
        raise FileNotFoundError(
            f"--model {str(path)!r} {what}: name a directory that `pl-lowprec export` wrote (a merged model or a peft"
            f" adapter), or pass --ckpt_path with a training checkpoint instead.{gguf_files_beside(path)}"
        )
    if not (path / "config.json").is_file() and not (path / "adapter_config.json").is_file():
        raise FileNotFoundError(
            f"--model {str(path)!r} holds neither config.json (a merged model) nor adapter_config.json (a peft"
            f" adapter).{gguf_files_beside(path / 'config.json')}"
        )
    check_directory_generates(path)


def gguf_files_beside(path: Path) -> str:
    """For a ``--model`` that is not a model: the GGUF files of its directory (a GGUF export, whose Modelfile is
    Ollama's), each a ``--model`` that generate reads."""
    found = sorted(f for f in path.parent.glob("*.gguf") if f.is_file() and starts_as_gguf(f))
    if not found:
        return ""
    named = " or ".join(f"--model {str(f)!r}" for f in found[:4])
    what = "is a GGUF export" if (path.parent / "Modelfile").is_file() else "holds GGUF files"
    return f" Its directory {what}: pass the .gguf file itself, {named}."


def adapter_on_base(peft: Any, base_model: Any, adapter: Path, base_dir: Path) -> Any:
    """``PeftModel.from_pretrained``; an adapter whose tensors do not fit the base (trained on another model)
    refused naming both, where peft raised torch's size-mismatch traceback for every LoRA tensor."""
    try:
        return peft.PeftModel.from_pretrained(base_model, str(adapter))
    except RuntimeError as err:
        if "size mismatch" not in str(err):
            raise
        raise ValueError(
            f"The adapter {str(adapter)!r} does not fit the base model {str(base_dir)!r}: it was trained on a model"
            f" of other shapes ({mismatch_summary(err)}). Pass --base with the model it was"
            " trained on (its adapter_config.json names it as base_model_name_or_path)."
        ) from None


GENERATION_DTYPES = ("float32", "bfloat16", "float16")


def check_generation_dtype(dtype: str) -> torch.dtype:
    """``--dtype`` as a torch dtype: one of ``GENERATION_DTYPES``."""
    if dtype not in GENERATION_DTYPES:
        raise ValueError(
            f"--dtype {dtype!r} is not a dtype to generate in: give one of {', '.join(GENERATION_DTYPES)} (float32,"
            " the default, as a GGUF file is read, so each form of an export computes alike; bfloat16 halves the"
            " memory on a GPU)."
        )
    return getattr(torch, dtype)


def from_directory(
    directory: str | Path,
    base: str | Path | None = None,
    device: str | torch.device = "auto",
    tokenizer: Any = None,
    dtype: str = "float32",
) -> Generator:
    """A merged model directory, a peft adapter directory on its base model (``adapter_base``), or a GGUF file, in
    ``dtype``; ``tokenizer`` if given, else the one of ``directory_tokenizer``. Every form computes in the same
    dtype: transformers would load a bf16 checkpoint in bf16 and a GGUF file in float32, and comparing the two
    would then measure the arithmetic as well as the export."""
    from transformers import AutoModelForCausalLM  # optional (pl_lowprec[hf]), needed only here

    path = Path(directory)
    check_model_dir(path)
    torch_dtype = check_generation_dtype(dtype)
    target = generation_device(device)
    base_dir = adapter_base(path, base)
    if is_gguf(path):
        model = gguf_model(path, torch_dtype)
    elif base_dir is not None:
        peft = import_peft()
        base_model = AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch_dtype)
        model = adapter_on_base(peft, base_model, path, base_dir)
    else:  # check_model_dir: config.json is there
        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch_dtype)
    if tokenizer is None:
        tokenizer = model_tokenizer(directory_tokenizer(path, base_dir and str(base_dir)))
    return Generator(model.to(target), tokenizer)  # loaded in dtype; rotary inv_freq (and peft's adapters) stay fp32
