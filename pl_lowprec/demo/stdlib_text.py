"""Causal-LM batches cut from the Python standard library's own source files.

Every machine that runs Python has this text, so the default task needs no download. Tokens are bytes
(vocabulary 256): no tokenizer to fetch or train, and any model with ``vocab_size >= 256`` can read it.
"""

from __future__ import annotations

import math
import sysconfig
from pathlib import Path

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, TensorDataset

from pl_lowprec._checks import check_at_least
from pl_lowprec.data.resumable import resumable_loader

VOCAB_SIZE = 256


def stdlib_bytes(max_bytes: int) -> bytes:
    """The first ``max_bytes`` of the standard library's top-level ``*.py`` files, in sorted order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    chunks, total = [], 0
    for path in sorted(root.glob("*.py")):
        data = path.read_bytes()
        chunks.append(data)
        total += len(data)
        if total >= max_bytes:
            break
    return b"".join(chunks)[:max_bytes]


def windows(tokens: torch.Tensor, seq_len: int) -> torch.Tensor:
    """Non-overlapping ``[n, seq_len]`` windows; the model shifts them for next-token targets."""
    n = tokens.numel() // seq_len
    return tokens[: n * seq_len].view(n, seq_len)


class StdlibTextDataModule(pl.LightningDataModule):
    """Byte-level language modelling on local Python sources; batches are ``{"input_ids": LongTensor}``.

    Args:
        seq_len: Tokens (bytes) per sample.
        batch_size: Samples per batch.
        max_bytes: How much text to read; the last ``val_fraction`` of it is the validation split.
        val_fraction: Share of the text held out for validation.
    """

    def __init__(
        self, seq_len: int = 128, batch_size: int = 8, max_bytes: int = 1_000_000, val_fraction: float = 0.05
    ) -> None:
        super().__init__()
        if seq_len < 2:
            raise ValueError(f"StdlibTextDataModule(seq_len={seq_len}) needs at least 2 tokens per sample.")
        if not 0 < val_fraction < 1:
            raise ValueError(f"StdlibTextDataModule(val_fraction={val_fraction}) must be between 0 and 1.")
        check_at_least("StdlibTextDataModule", 1, batch_size=batch_size)
        # both splits need one window of seq_len bytes
        needed = math.ceil(seq_len / min(val_fraction, 1 - val_fraction))
        check_at_least("StdlibTextDataModule", needed, f"Each split needs {seq_len} bytes.", max_bytes=max_bytes)
        self.seq_len = seq_len
        self.batch_size = batch_size
        self.max_bytes = max_bytes
        self.val_fraction = val_fraction
        self.train_set: TensorDataset | None = None
        self.val_set: TensorDataset | None = None

    def setup(self, stage: str) -> None:
        if self.train_set is not None:
            return
        tokens = torch.frombuffer(bytearray(stdlib_bytes(self.max_bytes)), dtype=torch.uint8).long()
        split = int(tokens.numel() * (1 - self.val_fraction))
        self.train_set = TensorDataset(windows(tokens[:split], self.seq_len))
        self.val_set = TensorDataset(windows(tokens[split:], self.seq_len))

    def _loader(self, dataset: TensorDataset, shuffle: bool) -> DataLoader:
        return DataLoader(dataset, batch_size=self.batch_size, shuffle=shuffle, collate_fn=_collate)

    def longest_train_row(self) -> int:
        """Every row is a window of ``seq_len`` bytes (what memory is sized for: ``memory.sizing_batch``)."""
        return self.seq_len

    def train_dataloader(self) -> DataLoader:
        """Shuffled by (seed 0, epoch) and resumable mid-epoch: a run killed and resumed from its last checkpoint
        trains on the batches an uninterrupted run would."""
        return resumable_loader(self.train_set, self.batch_size, _collate, self.trainer, seed=0)

    def val_dataloader(self) -> DataLoader:
        return self._loader(self.val_set, shuffle=False)

    def test_dataloader(self) -> DataLoader:
        return self._loader(self.val_set, shuffle=False)

    def predict_dataloader(self) -> DataLoader:
        return self._loader(self.val_set, shuffle=False)


def _collate(samples: list[tuple[torch.Tensor]]) -> dict[str, torch.Tensor]:
    return {"input_ids": torch.stack([s[0] for s in samples])}
