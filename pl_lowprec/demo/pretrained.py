"""``pl-lowprec make-demo-model OUT_DIR``: a small, really pretrained Hugging Face model, made on this machine.

No download is possible in many test and CI environments, so the demo's "hub model" is made here: a BPE
tokenizer trained with ``tokenizers`` and a small Llama trained briefly (fp32, plain AdamW loop) on the
Python standard library's sources, both saved with ``save_pretrained``. It then loads like any hub model:
``CausalLM(pretrained="OUT_DIR/model")``, ``AutoModelForCausalLM.from_pretrained("OUT_DIR/model")``.

Alongside it, ``OUT_DIR/data/{train,val}.jsonl`` hold a small prompt/completion task the base model does not
do: complete an annotated assignment ``NAME: TYPE =`` with the type's empty value (``int`` -> `` 0``, ``str`` ->
`` ''``, ``list`` -> `` []``, ``dict`` -> `` {}``), over the standard library's function names (validation names
are disjoint from training names). Greedy decoding of the base model completes none of the held-out prompts so;
a few dozen LoRA steps teach it (``benchmarks/finetune_demo.py`` prints the counts).
"""

from __future__ import annotations

import ast
import json
import math
import shutil
import sysconfig
import time
from collections.abc import Callable
from pathlib import Path

import torch

from pl_lowprec._checks import check_at_least
from pl_lowprec.demo.stdlib_text import stdlib_bytes
from pl_lowprec.demo.tokenizer import train_tokenizer


def stdlib_function_names(limit: int = 400) -> list[str]:
    """Distinct public function names defined in the standard library's top-level modules, sorted."""
    names: set[str] = set()
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError):
            continue
        names.update(
            n.name
            for n in ast.walk(tree)
            if isinstance(n, ast.FunctionDef)
            and n.name.isidentifier()
            and not n.name.startswith("_")
            and 3 <= len(n.name) <= 16
        )
        if len(names) >= limit:
            break
    return sorted(names)[:limit]


EMPTY_VALUES = {"int": "0", "str": "''", "list": "[]", "dict": "{}"}


def task_record(name: str, index: int) -> dict[str, str]:
    """``{"prompt": "NAME: TYPE =", "completion": " EMPTY\\n"}``, the type chosen by ``index``."""
    kind = list(EMPTY_VALUES)[index % len(EMPTY_VALUES)]
    return {"prompt": f"{name}: {kind} =", "completion": f" {EMPTY_VALUES[kind]}\n"}


def write_task(directory: Path, val_fraction: float = 0.2) -> tuple[Path, Path]:
    """The prompt/completion task as train.jsonl and val.jsonl (every fifth name held out)."""
    directory.mkdir(parents=True, exist_ok=True)
    names = stdlib_function_names()
    held_out = round(1 / val_fraction)
    rows = {"train": [], "val": []}
    for i, name in enumerate(names):
        split = "val" if i % held_out == 0 else "train"
        rows[split].append(task_record(name, i))
    paths = []
    for split, records in rows.items():
        path = directory / f"{split}.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in records))
        paths.append(path)
    return paths[0], paths[1]


DEMO_DATA_FILES = {"train.jsonl", "val.jsonl"}


def check_out_dir(out: Path, overwrite: bool) -> None:
    """``out/model`` and ``out/data`` must be empty or absent, or, with ``overwrite``, an earlier demo's."""
    for target in (out / "model", out / "data"):
        if not target.exists() or (target.is_dir() and not any(target.iterdir())):
            continue
        written = {p.name for p in target.iterdir()} if target.is_dir() else set()
        if target.name == "model":
            earlier = "pretraining.json" in written
        else:
            earlier = bool(written) and written <= DEMO_DATA_FILES
        if not earlier:
            raise ValueError(
                f"{target} holds files make-demo-model did not write, so it replaces nothing there, not even with"
                " --overwrite. Name another OUT_DIR."
            )
        if not overwrite:
            raise ValueError(
                f"{target} holds an earlier demo (make-demo-model wrote it): pass --overwrite to replace it, or"
                " name another OUT_DIR."
            )


def make_demo_model(
    out_dir: str | Path,
    steps: int = 300,
    hidden_size: int = 128,
    num_layers: int = 2,
    vocab_size: int = 1024,
    seq_len: int = 128,
    batch_size: int = 16,
    max_bytes: int = 2_000_000,
    seed: int = 0,
    overwrite: bool = False,
    progress: Callable[[str], None] | None = None,
) -> Path:
    """Train and save the tokenizer and model to ``out_dir/model`` and the task to ``out_dir/data``; an earlier
    demo there is replaced only with ``overwrite``, anything else never. ``progress`` gets a line at the start and
    at each tenth of the steps (``pl-lowprec make-demo-model`` prints them: it runs for a minute or more)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    check_at_least("make_demo_model", 1, steps=steps, hidden_size=hidden_size, num_layers=num_layers)
    check_at_least("make_demo_model", 1, batch_size=batch_size, max_bytes=max_bytes)
    check_at_least("make_demo_model", 2, seq_len=seq_len)
    check_at_least("make_demo_model", 256, "The tokenizer holds the 256 bytes first.", vocab_size=vocab_size)

    out = Path(out_dir)
    model_dir = out / "model"
    check_out_dir(out, overwrite)
    torch.manual_seed(seed)
    text = stdlib_bytes(max_bytes).decode("utf-8", errors="replace")
    tokenizer = train_tokenizer([text], vocab_size)
    ids = torch.tensor(tokenizer(text)["input_ids"])
    blocks = ids[: ids.numel() // seq_len * seq_len].view(-1, seq_len)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=hidden_size * 3,
        num_hidden_layers=num_layers,
        num_attention_heads=max(1, hidden_size // 32),
        num_key_value_heads=max(1, hidden_size // 32),
        max_position_embeddings=max(512, seq_len),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(config)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / 20) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, s / steps))))
    )
    g = torch.Generator().manual_seed(seed)
    started, losses = time.perf_counter(), []
    say = progress or (lambda line: None)
    parameters = sum(p.numel() for p in model.parameters())
    say(f"Pre-training a {num_layers}-layer Llama ({parameters:,} parameters) for {steps} steps on Python's sources.")
    model.train()
    for step in range(steps):
        batch = blocks[torch.randint(0, len(blocks), (batch_size,), generator=g)]
        loss = model(input_ids=batch, labels=batch, use_cache=False).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
        if (step + 1) % max(1, steps // 10) == 0 or step + 1 == steps:
            say(f"step {step + 1}/{steps}: loss {losses[-1]:.2f} ({time.perf_counter() - started:.0f} s)")
    if model_dir.is_dir():
        shutil.rmtree(model_dir)  # an earlier demo (check_out_dir): no stale file of it stays beside the new one
    model.save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    write_task(out / "data")
    summary = {
        "steps": steps,
        "parameters": parameters,
        "first_loss": losses[0] if losses else None,
        "last_loss": sum(losses[-10:]) / len(losses[-10:]) if losses else None,
        "seconds": round(time.perf_counter() - started, 1),
    }
    (model_dir / "pretraining.json").write_text(json.dumps(summary, indent=2))
    return model_dir
