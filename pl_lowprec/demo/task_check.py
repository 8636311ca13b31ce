"""Does fine-tuning teach the demo task? Validation loss and greedy completions of held-out prompts, before/after.

The same commands a user runs: ``pl-lowprec validate`` and ``fit`` on ``configs/finetune-causal-lm.yaml``, and
``pl-lowprec generate`` (here its functions) on the base model and on the fine-tuned checkpoint. A completion
matches when its first line is the reference's (`` 0``, `` ''``, `` []`` or `` {}`` for ``NAME: TYPE =``).
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path

from pl_lowprec.cli.generate import from_checkpoint
from pl_lowprec.cli.lightning_cli import build_cli
from pl_lowprec.export.generate import Decoding, Generator, from_directory
from pl_lowprec.export.prompt_files import read_prompts

CONFIG = Path(__file__).resolve().parents[2] / "configs" / "finetune-causal-lm.yaml"


@dataclass
class TaskCheck:
    val_loss_before: float
    val_loss_after: float
    matches_before: int
    matches_after: int
    prompts: int
    steps: int


def first_line(text: str) -> str:
    return text.split("\n", 1)[0].strip()


def count_matches(generator: Generator, records: list[dict], max_new_tokens: int = 8) -> int:
    completions = generator.complete([r["prompt"] for r in records], Decoding(max_new_tokens=max_new_tokens))
    return sum(first_line(c) == first_line(r["completion"]) for c, r in zip(completions, records, strict=True))


def config_args(demo_dir: Path, work_dir: Path, extra: list[str]) -> list[str]:
    """The fine-tuning config pointed at a demo directory, writing under ``work_dir``."""
    return [
        f"--config={CONFIG}",
        f"--model.pretrained={demo_dir / 'model'}",
        f"--data.tokenizer={demo_dir / 'model'}",
        f"--data.train_files={demo_dir / 'data' / 'train.jsonl'}",
        f"--data.val_files={demo_dir / 'data' / 'val.jsonl'}",
        f"--trainer.default_root_dir={work_dir}",
        "--trainer.enable_progress_bar=false",
        *extra,
    ]


def check_task(demo_dir: str | Path, work_dir: str | Path, extra: list[str] = ()) -> TaskCheck:
    """Validate the base model, fine-tune it with the config (plus ``extra`` overrides), validate and generate."""
    demo_dir, work_dir = Path(demo_dir), Path(work_dir)
    args = config_args(demo_dir, work_dir, list(extra))
    records = read_prompts(demo_dir / "data" / "val.jsonl")
    before = build_cli(["validate", *args, "--trainer.logger=false"]).trainer.callback_metrics["val/loss"].item()
    matches_before = count_matches(from_directory(demo_dir / "model", device="cpu"), records)
    fit = build_cli(["fit", *args])
    after = fit.trainer.callback_metrics["val/loss"].item()
    checkpoint = Path(fit.trainer.checkpoint_callback.last_model_path)
    matches_after = count_matches(from_checkpoint(checkpoint, args), records)
    return TaskCheck(before, after, matches_before, matches_after, len(records), fit.trainer.global_step)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("demo_dir", help="Made by `pl-lowprec make-demo-model DEMO_DIR`.")
    parser.add_argument("work_dir")
    parsed, extra = parser.parse_known_args()
    print(json.dumps(check_task(parsed.demo_dir, parsed.work_dir, extra).__dict__, indent=2))
