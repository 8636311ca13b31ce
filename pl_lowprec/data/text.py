"""``TextDataModule``: fine-tune a causal LM on your own ``.txt`` and ``.jsonl`` files.

Batches follow the Hugging Face convention: ``input_ids`` and ``attention_mask`` [B, T], ``labels`` [B, T]
with -100 where no loss is taken (the model shifts them). With ``packing=True`` a row holds several samples and
the batch has ``position_ids`` instead of ``attention_mask`` (``pl_lowprec.data.packing``).
The training loader resumes mid-epoch exactly (``pl_lowprec.data.resumable``). Unusable records are counted by
reason with their line numbers and logged; a file with no usable record fails with its path.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities.model_helpers import is_overridden
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch.utils.data import DataLoader, Dataset

from pl_lowprec._checks import check_at_least
from pl_lowprec.data.collate import PackedCollate, PadCollate
from pl_lowprec.data.packing import PackedRows, document_row, padding_fraction
from pl_lowprec.data.packing_guard import PackingGuard
from pl_lowprec.data.records import (
    SUFFIXES,
    FileReport,
    Sample,
    encode_messages,
    encode_prompt_completion,
    encode_text,
    read_records,
    record_kind,
)
from pl_lowprec.data.resumable import resumable_loader
from pl_lowprec.loading.tokenizer import load_tokenizer
from pl_lowprec.models.token_loss import IGNORE_INDEX

# Files a directory of records may hold that this module does not read: refused rather than skipped in silence.
# Others (a README.md, a .gitattributes) are listed in the log.
DATA_SUFFIXES = {".json", ".csv", ".tsv", ".parquet", ".arrow", ".gz", ".bz2", ".xz", ".zst", ".zip"}


def directory_files(path: Path, argument: str) -> list[Path]:
    """The ``.txt`` / ``.jsonl`` files under ``path``; records in other formats are an error that lists them."""
    files = [
        p
        for p in sorted(path.rglob("*"))
        if p.is_file() and not any(part.startswith(".") for part in p.relative_to(path).parts)
    ]
    read = [p for p in files if p.suffix in SUFFIXES]
    unread = [p for p in files if p.suffix not in SUFFIXES]
    by_suffix = Counter(p.suffix or p.name for p in unread)
    listed = ", ".join(f"{n} {suffix}" for suffix, n in sorted(by_suffix.items()))
    if any(p.suffix in DATA_SUFFIXES for p in unread):
        raise ValueError(
            f"{argument}: directory {str(path)!r} holds files this module does not read ({listed}) beside"
            f" {len(read)} .txt/.jsonl files. Convert them to .jsonl (one JSON record per line), move them out, or"
            " name the files to use instead of the directory."
        )
    if not read:
        raise ValueError(f"{argument}: directory {str(path)!r} holds no .txt or .jsonl file.")
    if unread:
        rank_zero_info(f"{argument}: {str(path)!r}: read {len(read)} .txt/.jsonl files; not read: {listed}.")
    return read


def data_files(files: str | Path | Sequence[str | Path], argument: str) -> list[Path]:
    """Files named directly or found in named directories; ``ValueError`` for anything else."""
    named = [files] if isinstance(files, (str, Path)) else list(files)
    found: list[Path] = []
    for item in named:
        path = Path(item).expanduser()
        if path.is_dir():
            found += directory_files(path, argument)
        elif path.is_file() and path.suffix in SUFFIXES:
            found.append(path)
        else:
            what = "does not exist" if not path.exists() else f"is not a .txt or .jsonl file ({path.suffix!r})"
            raise ValueError(f"{argument}: {str(path)!r} {what}. Give .txt or .jsonl files or directories of them.")
    return found


class TextDataModule(pl.LightningDataModule):
    """Causal-LM data from ``.txt`` / ``.jsonl`` files (fields ``text``, ``prompt``/``completion``, ``messages``).

    Args:
        train_files: Files or directories for training.
        tokenizer: The model directory (or hub id) whose tokenizer to use, usually the model's ``pretrained``.
        val_files: Files for validation; ``None`` holds out ``val_fraction`` of the training samples.
        seq_len: Tokens per block of packed ``text``; longer prompt/completion and chat samples are truncated.
        batch_size: Samples per batch (per process under DDP).
        val_fraction: Share held out when ``val_files`` is ``None`` (0 for none).
        seed: Seed of the split and of the training order (which depends on the epoch too).
        num_workers: ``DataLoader`` worker processes.
        max_truncated_fraction: Share of a file's prompt/completion and chat target tokens that ``seq_len`` may
            cut off; above it the file is refused with the ``seq_len`` that keeps 95% (1.0 accepts any loss).
        packing: Put several prompt/completion or chat samples in each row of ``seq_len`` (best-fit decreasing,
            repacked each epoch), with ``position_ids`` restarting per sample and attention cut between them;
            ``text`` documents get their attention cut at each EOS. Worth it when sample lengths vary widely:
            it removes the padding. The LightningModule must declare ``accepts_packed_batches = True`` and call
            its model with ``position_ids``, no ``attention_mask`` and ``use_cache=False``
            (``pl_lowprec.models.forward_batch``); the first packed batches check that it keeps samples apart.
    """

    def __init__(
        self,
        train_files: str | list[str],
        tokenizer: str,
        val_files: str | list[str] | None = None,
        seq_len: int = 512,
        batch_size: int = 8,
        val_fraction: float = 0.05,
        seed: int = 0,
        num_workers: int = 0,
        max_truncated_fraction: float = 0.05,
        packing: bool = False,
    ) -> None:
        super().__init__()
        if seq_len < 2:
            raise ValueError(f"TextDataModule(seq_len={seq_len}) needs at least 2 tokens per sample.")
        if batch_size < 1:
            raise ValueError(f"TextDataModule(batch_size={batch_size}) must be at least 1.")
        if not 0 <= val_fraction < 1:
            raise ValueError(f"TextDataModule(val_fraction={val_fraction}) must be in [0, 1).")
        check_at_least("TextDataModule", 0, "0 loads batches in the main process.", num_workers=num_workers)
        if not 0 <= max_truncated_fraction <= 1:
            raise ValueError(f"TextDataModule(max_truncated_fraction={max_truncated_fraction}) must be in [0, 1].")
        self.save_hyperparameters()  # saved in checkpoints: a resumption with other data is refused (resume.py)
        self.train_paths = data_files(train_files, "train_files")
        self.val_paths = data_files(val_files, "val_files") if val_files is not None else None
        self.tokenizer_dir = tokenizer
        self.seq_len = seq_len
        self.batch_size = batch_size
        self.val_fraction = val_fraction
        self.seed = seed
        self.num_workers = num_workers
        self.max_truncated_fraction = max_truncated_fraction
        self.packing = packing
        self.tokenizer: Any = None
        self.reports: list[FileReport] = []
        self.train_set: Dataset | None = None
        self.val_set: Dataset = []
        self.packing_guard: PackingGuard | None = None

    def setup(self, stage: str) -> None:
        if self.packing:  # refuses an undeclared module now, checks the first packed batches (packing_guard)
            self.packing_guard = PackingGuard(self.trainer.lightning_module if self.trainer is not None else None)
        if self.train_set is not None:
            return
        self.tokenizer = load_tokenizer(self.tokenizer_dir)
        train = self._samples(self.train_paths)
        if self.val_paths is not None:
            self.train_set, self.val_set = train, self._samples(self.val_paths)
        else:
            order = torch.randperm(len(train), generator=torch.Generator().manual_seed(self.seed)).tolist()
            n_val = round(len(train) * self.val_fraction)
            n_val = max(n_val, 1) if self.val_fraction > 0 and len(train) > 1 else n_val
            self.val_set = [train[i] for i in order[:n_val]]
            self.train_set = [train[i] for i in sorted(order[n_val:])]
        rank_zero_info(f"TextDataModule: {len(self.train_set)} training and {len(self.val_set)} validation samples.")
        if self.packing:
            self._pack()

    def _pack(self) -> None:
        """Replace the sample lists by packed rows, and log what packing saves."""
        train = self.train_set
        self.train_set = packed_rows(train, self.seq_len, self.seed)
        self.val_set = packed_rows(self.val_set, self.seq_len, self.seed)
        before = padding_fraction([len(s["input_ids"]) for s in train], self.batch_size, self.seed)
        after = padding_fraction(self.train_set.row_lengths(), self.batch_size, self.seed)
        rank_zero_info(
            f"TextDataModule(packing=True): {len(train)} training samples in {len(self.train_set)} rows of"
            f" seq_len={self.seq_len}; padding {before:.1%} of the batch tokens without packing, {after:.1%} with."
        )

    def _samples(self, paths: list[Path]) -> list[dict[str, torch.Tensor]]:
        samples: list[Sample] = []
        for path in paths:
            report = FileReport(path)
            samples += self._file_samples(path, report)
            self.reports.append(report)
            rank_zero_info(report.describe())
            if report.used == 0:
                raise ValueError(f"No usable record in {report.describe()}.")
            self._check_truncation(report)
        return [self._tensors(s) for s in samples]

    def _tensors(self, sample: Sample) -> dict[str, torch.Tensor]:
        """A sample as tensors; a ``text`` block under packing is a ready row, cut at each document's EOS."""
        if sample.text_block and self.packing:
            return document_row(sample.input_ids, self.tokenizer.eos_token_id)
        return {"input_ids": torch.tensor(sample.input_ids), "labels": torch.tensor(sample.labels)}

    def _check_truncation(self, report: FileReport) -> None:
        """A file that ``seq_len`` cuts more than ``max_truncated_fraction`` of its target tokens from is refused."""
        if report.lost_share() <= self.max_truncated_fraction:
            return
        suggested = report.seq_len_keeping(0.95)
        raise ValueError(
            f"{report.path}: seq_len={self.seq_len} cuts {report.truncated} samples, losing"
            f" {report.lost_target_tokens} of the file's {report.target_tokens} target tokens"
            f" ({report.lost_share():.1%}),"
            f" more than max_truncated_fraction={self.max_truncated_fraction}. seq_len={suggested} keeps 95% of"
            f" them: pass --data.seq_len {suggested}, or accept the loss with --data.max_truncated_fraction"
            f" {min(1.0, round(report.lost_share() + 0.005, 2))}."
        )

    def _file_samples(self, path: Path, report: FileReport) -> list[Sample]:
        """One file's samples: its text records packed into ``seq_len`` blocks, the others one sample each."""
        stream: list[int] = []
        samples: list[Sample] = []
        for line, record in read_records(path, report):
            sample_or_reason = self._encode(record, report)
            if isinstance(sample_or_reason, str):
                report.reject(sample_or_reason, line)
            elif isinstance(sample_or_reason, list):
                stream += sample_or_reason
                report.used += 1
            else:
                samples.append(sample_or_reason)
                report.used += 1
        for start in range(0, len(stream) - 1, self.seq_len):
            block = stream[start : start + self.seq_len]
            if len(block) >= 2:
                samples.append(Sample(block, list(block), text_block=True))
        return samples

    def _encode(self, record: dict[str, Any], report: FileReport) -> Sample | list[int] | str:
        """A sample, a token stream to pack (text), or the reason the record is unusable."""
        kind = record_kind(record)
        if kind is None:
            return "records without a 'text', 'prompt'/'completion' or 'messages' field"
        if kind == "text":
            if not isinstance(record["text"], str) or not record["text"].strip():
                return "records with empty text"
            return encode_text(self.tokenizer, record["text"])
        if kind == "prompt_completion":
            prompt, completion = record.get("prompt"), record.get("completion")
            if not isinstance(prompt, str) or not isinstance(completion, str):
                return "records with 'prompt' and 'completion' not both strings"
            if not completion.strip():
                return "records with an empty completion"
            sample = encode_prompt_completion(self.tokenizer, prompt, completion)
        else:
            messages = record["messages"]
            if not isinstance(messages, list) or not all(
                isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                for m in messages
            ):
                return "records whose 'messages' is not a list of {role, content}"
            if self.tokenizer.chat_template is None:
                raise ValueError(
                    f"'messages' records need a chat template, and the tokenizer in {self.tokenizer_dir!r} has none."
                    " Use a chat model's tokenizer or convert the records to prompt/completion."
                )
            sample = encode_messages(self.tokenizer, messages)
        report.count_targets(sample.labels, self.seq_len)
        sample = Sample(sample.input_ids[: self.seq_len], sample.labels[: self.seq_len])
        if all(label == IGNORE_INDEX for label in sample.labels[1:]):
            return f"records with no target tokens within seq_len={self.seq_len}"
        return sample

    def on_after_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        """A batch on its device, before the step: the first packed ones check the module (``PackingGuard``).
        Lightning calls only the data module's hook when both have one, so the module's own runs here, after."""
        if self.trainer is None:
            return batch
        if self.packing_guard is not None:
            self.packing_guard.check(self.trainer, batch)
        module = self.trainer.lightning_module
        if is_overridden("on_after_batch_transfer", module, pl.LightningModule):
            return module.on_after_batch_transfer(batch, dataloader_idx)
        return batch

    def train_dataloader(self) -> DataLoader:
        return resumable_loader(
            self.train_set,
            self.batch_size,
            self._collate(),
            self.trainer,
            self.seed,
            self.num_workers,
            epoch_indexed=self.packing,
        )

    def val_dataloader(self) -> DataLoader:
        return DataLoader(
            self.val_set, batch_size=self.batch_size, collate_fn=self._collate(), num_workers=self.num_workers
        )

    def _collate(self) -> PadCollate | PackedCollate:
        pad = self.tokenizer.pad_token_id
        pad = self.tokenizer.eos_token_id if pad is None else pad
        return PackedCollate(pad) if self.packing else PadCollate(pad)


def packed_rows(samples: list[dict[str, torch.Tensor]], seq_len: int, seed: int) -> PackedRows:
    """``text`` rows (which carry ``position_ids`` already) as they are; the other samples packed."""
    ready = [s for s in samples if "position_ids" in s]
    return PackedRows([s for s in samples if "position_ids" not in s], seq_len, seed, ready=ready)
