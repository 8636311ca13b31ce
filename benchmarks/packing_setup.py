"""TextDataModule(packing=True).setup on a Parquet file: seconds, and the Arrow rows it decoded to find each sample's
length and whether it is a ``text`` block (``pl_lowprec/data/row_facts.py`` reads both from the columns).

python benchmarks/packing_setup.py [--records 100000]
Data: ``text`` records of 5-60 words drawn from Python's own ``os.py`` source (seed 0), written as Parquet; the
tokenizer is ``benchmarks/fit_inputs.py``'s 2,000-token BPE, trained on the standard library's sources.
"""

from __future__ import annotations

import argparse
import os as os_module
import random
import tempfile
import time
import warnings
from pathlib import Path

import datasets
import pyarrow as pa
import pyarrow.parquet as pq

from pl_lowprec.data import TextDataModule, token_table
from pl_lowprec.demo.stdlib_text import stdlib_bytes
from pl_lowprec.demo.tokenizer import train_tokenizer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--records", type=int, default=100_000)
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    datasets.disable_progress_bars()
    words = Path(os_module.__file__).read_text().split()
    generator = random.Random(0)
    rows = [{"text": " ".join(generator.choices(words, k=generator.randint(5, 60)))} for _ in range(args.records)]
    with tempfile.TemporaryDirectory() as directory:
        root = Path(directory)
        pq.write_table(pa.Table.from_pylist(rows), root / "train.parquet")
        text = stdlib_bytes(1_000_000).decode("utf-8", "ignore")
        train_tokenizer([text[i : i + 20_000] for i in range(0, len(text), 20_000)], vocab_size=2000).save_pretrained(
            root
        )
        reads = [0]
        read_row = token_table.TokenRows.__getitem__

        def counted(rows: token_table.TokenRows, index: int) -> dict:
            reads[0] += 1
            return read_row(rows, index)

        token_table.TokenRows.__getitem__ = counted
        data = TextDataModule(
            tokenizer=str(root), train_files=[str(root / "train.parquet")], val_files=None, seq_len=256, packing=True
        )
        started = time.perf_counter()
        data.setup("fit")
        seconds = time.perf_counter() - started
    print(
        f"{args.records:,} Parquet text records, packing=True, seq_len 256: setup {seconds:.1f} s,"
        f" {reads[0]:,} Arrow rows decoded, {len(data.train_set):,} training rows"
    )


if __name__ == "__main__":
    main()
