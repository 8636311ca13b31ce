"""Inputs for ``pl-lowprec fit`` on a model directory that has weights only (``gpu_peers.write_random_checkpoint``):
a 2,000-token BPE tokenizer saved beside the weights, and ``train.jsonl`` of ``text`` records cut from Python's
standard-library sources (20,000 characters each, enough to fill 2,048-token rows).

python benchmarks/fit_inputs.py DIR, then pl-lowprec fit ... --model.pretrained DIR --data.tokenizer DIR
--data.train_files DIR/train.jsonl
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from pl_lowprec.demo.stdlib_text import stdlib_bytes
from pl_lowprec.demo.tokenizer import train_tokenizer

RECORD_CHARS = 20_000


def write_fit_inputs(directory: Path, max_bytes: int = 6_000_000) -> int:
    """The tokenizer and ``train.jsonl`` in ``directory``; returns the number of records."""
    text = stdlib_bytes(max_bytes).decode("utf-8", "ignore")
    records = [text[i : i + RECORD_CHARS] for i in range(0, len(text), RECORD_CHARS)]
    train_tokenizer(records[:60], vocab_size=2000).save_pretrained(directory)
    with open(directory / "train.jsonl", "w") as out:
        for record in records:
            out.write(json.dumps({"text": record}) + "\n")
    return len(records)


if __name__ == "__main__":
    print(f"{write_fit_inputs(Path(sys.argv[1]))} records")
