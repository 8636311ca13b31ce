"""``TextDataModule``: fine-tune a causal LM on your own records: ``.txt``/``.jsonl`` files, and through Hugging
Face ``datasets`` Parquet, CSV, JSON and Arrow files, saved datasets, hub ids and ``datasets.Dataset`` objects.

Batches follow the Hugging Face convention: ``input_ids`` and ``attention_mask`` [B, T], ``labels`` [B, T]
with -100 where no loss is taken (the model shifts them). With ``packing=True`` a row holds several samples and
the batch has ``position_ids`` instead of ``attention_mask`` (``pl_lowprec.data.packing``).
The training loader resumes mid-epoch exactly (``pl_lowprec.data.resumable``). Every source goes through one
record → tokens step (``_encode_records``); a dataset's samples stay in a memory-mapped Arrow table
(``pl_lowprec.data.token_table``). Unusable records are counted by reason with their line numbers (row indices
for a dataset) and logged; a source with no usable record fails with its name, and so does one with more than
``max_skipped_fraction`` of its records unusable (a column named otherwise, a role named ``model``, would otherwise
train on what is left with one log line).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities.model_helpers import is_overridden
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch.utils.data import DataLoader, Dataset

from pl_lowprec._checks import check_at_least
from pl_lowprec._hparams import paths_as_strings
from pl_lowprec.data.chat import (
    ChatTemplate,
    ChatTemplateMismatch,
    TemplateFieldError,
    UnusableChatRecord,
    empty_answer_reason,
    no_answer_reason,
    turns_problem,
    without_doubled_eos,
)
from pl_lowprec.data.collate import PackedCollate, PadCollate
from pl_lowprec.data.context_length import check_seq_len_with_model
from pl_lowprec.data.dataset_files import open_dataset
from pl_lowprec.data.fields import (
    ALPACA_COLUMNS,
    SHAREGPT_COLUMN,
    check_columns,
    check_fields,
    columns_read,
    missing_field_reason,
    read_fields,
    unread_columns,
)
from pl_lowprec.data.packing import PackedRows, padding_fraction
from pl_lowprec.data.packing_guard import PackingGuard
from pl_lowprec.data.record_split import SourceRows, every_row, split_records
from pl_lowprec.data.records import (
    FileReport,
    Sample,
    encode_prompt_completion,
    encode_text,
    read_records,
    record_kind,
)
from pl_lowprec.data.resumable import resumable_loader
from pl_lowprec.data.row_facts import ready_rows, row_lengths
from pl_lowprec.data.row_views import subset
from pl_lowprec.data.sources import Source, describe_objects, is_dataset_object, resolve_sources
from pl_lowprec.data.split_options import check_split, validation_sources
from pl_lowprec.data.template_arguments import check_template_arguments
from pl_lowprec.data.text_blocks import DocumentList, Documents, TextBlocks
from pl_lowprec.data.token_table import TokenRows, read_table, table_path, tokenize
from pl_lowprec.data.turn_end import NoTurnEnd
from pl_lowprec.data.validation_split import (
    DEFAULT_VAL_FRACTION,
    warn_unused_val_fraction,
    warn_validation_on_training_files,
)
from pl_lowprec.distributed.once_per_node import once_per_node
from pl_lowprec.loading.tokenizer import load_tokenizer
from pl_lowprec.models.token_loss import IGNORE_INDEX

Row = dict[str, torch.Tensor]

# Paths, or (in Python) a datasets.Dataset / DatasetDict. ``Any`` stands for the datasets classes: naming a class
# in the union makes LightningCLI (jsonargparse) read a path's file as a config and pass its text instead.
DataFiles = str | list[str] | Any
VAL_SPLITS = ("validation", "test")  # val_split=None: the first of these a DatasetDict has


def check_tokenizer_with_model(trainer: Any, tokenizer: Any, source: str | None) -> None:
    """The module's own check of the data's tokenizer (``CausalLM.check_data_tokenizer``), if it has one: a
    tokenizer of another model is the root cause of what the records' checks would report first."""
    module = getattr(trainer, "lightning_module", None) if trainer is not None else None
    check = getattr(module, "check_data_tokenizer", None)
    if callable(check):
        check(tokenizer, source)


class TextDataModule(pl.LightningDataModule):
    """Causal-LM data from records with the fields ``text``, ``prompt``/``completion`` (strings, or lists of chat
    turns) or ``messages``; a chat record's ``tools`` and ``chat_template_kwargs`` go to the chat template.

    Args:
        train_files: For training: ``.txt``, ``.jsonl``, ``.parquet``, ``.csv``, ``.json`` or ``.arrow`` files,
            directories of them, glob patterns, directories written by ``save_to_disk``, a hub dataset id
            (``org/name``; needs the network), or a ``datasets.Dataset`` / ``DatasetDict`` (in Python). All but
            ``.txt``/``.jsonl`` need ``pl_lowprec[datasets]``.
        tokenizer: The model directory (or hub id) whose tokenizer to use, usually the model's ``pretrained``.
        val_files: The same for validation; ``None`` holds out ``val_fraction`` of the training records.
        seq_len: Tokens per block of packed ``text``; longer prompt/completion and chat samples are truncated.
        batch_size: Samples per batch (per process under DDP); with ``packing``, rows of ``seq_len`` tokens.
        val_fraction: Share held out when ``val_files`` is ``None`` (0 for none): of the records, each ``text``
            record whole, before the text is cut into ``seq_len`` blocks, so no record both trains and
            validates; where the text is a single record (one ``.txt`` file), of its blocks. The log says which.
        seed: Seed of the split and of the training order (which depends on the epoch too).
        num_workers: ``DataLoader`` worker processes.
        max_truncated_fraction: Share of a file's prompt/completion and chat target tokens that ``seq_len`` may
            cut off; above it the file is refused with the ``seq_len`` that keeps 95% (1.0 accepts any loss).
        packing: Put several prompt/completion or chat samples in each row of ``seq_len`` (best-fit decreasing,
            repacked each epoch), with ``position_ids`` restarting per sample and attention cut between them;
            ``text`` blocks get theirs cut where each record starts, never at an EOS inside a record (a chat
            rendered to text, whose EOS ends every turn). Worth it when sample lengths vary widely:
            it removes the padding. The LightningModule must declare ``accepts_packed_batches = True`` and call
            its model with ``position_ids``, no ``attention_mask`` and ``use_cache=False``
            (``pl_lowprec.models.forward_batch``); the first packed batches check that it keeps samples apart.
        fields: Your column names for the fields read, instead of renaming them by hand: ``{"prompt":
            "question", "completion": "answer"}``, ``{"text": "content"}`` or ``{"messages": "dialog"}``; only the
            named columns are read. ShareGPT's ``conversations`` (``from``/``value`` turns, roles human/gpt/system;
            a ``system`` column beside them is the first turn) are read as ``messages`` without a mapping, and so
            are alpaca records (``instruction``, ``input``, ``output``, ``system``, ``history``), as LLaMA-Factory
            reads them.
        train_split: The split of a ``DatasetDict`` (hub id, saved or in Python) in ``train_files`` to train on.
            A file or a single ``Dataset`` is one split, ``train``: another name for it is refused.
        val_split: The split of a ``DatasetDict`` in ``val_files``; ``None``: ``validation``, else ``test``.
            Without ``val_files``, that split of ``train_files``' dataset dicts validates (TRL's
            ``dataset_test_split``) instead of ``val_fraction`` of the training records.
        chat_template_kwargs: Arguments of the chat template for every chat record (``{"enable_thinking":
            false}`` for Qwen3); a record's own ``chat_template_kwargs`` take precedence.
        join_text: ``text`` records joined and cut into ``seq_len`` blocks (``True``: a pretraining corpus, as
            Hugging Face's ``run_clm`` groups texts), or each one sample, truncated at ``seq_len`` and packed whole
            with ``packing`` (``False``: SFT on whole records, e.g. chats rendered to text, as TRL's
            ``SFTTrainer`` reads its text field). ``None``: joined, with a warning where a record that would fit
            one block is cut across two.
        eos_after_turns: What to do with an assistant turn the chat template ends with no end-of-turn token (a
            newline alone), which trains no token to stop on: ``None`` refuses it before any step, with the fix;
            ``True`` writes the tokenizer's EOS right after the turn's text, trained; ``False`` trains the turns as
            written (``pl_lowprec.data.turn_end``).
        max_skipped_fraction: Share of a file's records that may be unusable (counted by reason in the log); above
            it the file is refused with the reasons (1.0 accepts any loss). 0.05, as for truncation: scattered bad
            records pass, a format the module does not read for a large part of the file does not.
    """

    def __init__(
        self,
        train_files: DataFiles,
        tokenizer: str,
        val_files: DataFiles | None = None,
        seq_len: int = 512,
        batch_size: int = 8,
        val_fraction: float = DEFAULT_VAL_FRACTION,
        seed: int = 0,
        num_workers: int = 0,
        max_truncated_fraction: float = 0.05,
        packing: bool = False,
        fields: dict[str, str] | None = None,
        train_split: str = "train",
        val_split: str | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        max_skipped_fraction: float = 0.05,
        join_text: bool | None = None,
        eos_after_turns: bool | None = None,
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
        if not 0 <= max_skipped_fraction <= 1:
            raise ValueError(f"TextDataModule(max_skipped_fraction={max_skipped_fraction}) must be in [0, 1].")
        self.fields = check_fields(fields)
        if chat_template_kwargs is not None and not isinstance(chat_template_kwargs, dict):
            raise ValueError(
                f"TextDataModule(chat_template_kwargs={chat_template_kwargs!r}) must map the chat template's argument"
                " names to values, e.g. {'enable_thinking': False} (--data.chat_template_kwargs '{enable_thinking:"
                " false}')."
            )
        self.chat_template_kwargs = dict(chat_template_kwargs or {})
        # saved in checkpoints (a resumption with other data is refused, resume.py); a dataset object is described
        objects = {"train_files": train_files, "val_files": val_files}
        objects = {name: value for name, value in objects.items() if value is not None and is_dataset_object(value)}
        self.save_hyperparameters(ignore=list(objects))
        self.hparams.update({name: describe_objects(value) for name, value in objects.items()})
        paths_as_strings(self.hparams)
        self.train_sources = resolve_sources(train_files, "train_files")
        self.val_sources = resolve_sources(val_files, "val_files") if val_files is not None else None
        check_split("train_split", train_split, self.train_sources, "train_files")
        if self.val_sources is not None:
            check_split("val_split", val_split, self.val_sources, "val_files")
        elif val_split is not None:
            self.val_sources = validation_sources(val_split, self.train_sources)
        self.train_splits = (train_split,)
        self.val_splits = (val_split,) if val_split is not None else VAL_SPLITS
        self.tokenizer_dir = tokenizer
        self.seq_len = seq_len
        self.batch_size = batch_size
        self.val_fraction = val_fraction
        self.seed = seed
        self.num_workers = num_workers
        self.max_truncated_fraction = max_truncated_fraction
        self.max_skipped_fraction = max_skipped_fraction
        self.packing = packing
        self.join_text = join_text
        if eos_after_turns not in (None, True, False):
            raise ValueError(
                f"TextDataModule(eos_after_turns={eos_after_turns!r}) must be true (write the tokenizer's EOS after"
                " an assistant turn the chat template ends with no end token), false (train such turns as written)"
                " or null (refuse them)."
            )
        self.eos_after_turns = eos_after_turns
        self.text_records_cut = 0
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
        check_tokenizer_with_model(self.trainer, self.tokenizer, self.tokenizer_dir)  # before any record is read
        check_seq_len_with_model(self.trainer, self.seq_len)
        check_template_arguments(self.tokenizer, self.chat_template_kwargs, self.tokenizer_dir)
        train = self._samples(self.train_sources, self.train_splits, "train_files")
        if self.val_sources is not None:
            warn_unused_val_fraction(self.val_fraction)
            warn_validation_on_training_files(self.train_sources, self.val_sources)
            self.train_set = every_row(train, self._blocks)
            self.val_set = every_row(self._samples(self.val_sources, self.val_splits, "val_files"), self._blocks)
        else:
            self.train_set, self.val_set = split_records(train, self._blocks, self.val_fraction, self.seed)
        rank_zero_info(f"TextDataModule: {len(self.train_set)} training and {len(self.val_set)} validation samples.")
        self._warn_text_cut()
        if self.packing:
            self._pack()

    def _warn_text_cut(self) -> None:
        """Say, unless ``join_text`` was chosen, how many ``text`` records that fit one block were cut across two."""
        if self.join_text is None and self.text_records_cut:
            rank_zero_warn(
                f"TextDataModule: {self.text_records_cut} text records that would each fit in seq_len={self.seq_len}"
                " tokens are cut across two blocks, as text records are joined and cut into seq_len blocks (a"
                " pretraining corpus): each one's second part trains without its first, e.g. a chat rendered to"
                " text whose answer is cut from its question. For SFT on whole records, as TRL's SFTTrainer reads"
                " a text field, pass join_text=False (--data.join_text false): each record one sample, truncated"
                " at seq_len; join_text=True keeps the blocks without this warning."
            )

    def _pack(self) -> None:
        """Replace the sample lists by packed rows, and log what packing saves."""
        train, lengths = self.train_set, row_lengths(self.train_set)
        self.train_set = packed_rows(train, self.seq_len, self.seed, lengths)
        self.val_set = packed_rows(self.val_set, self.seq_len, self.seed)
        before = padding_fraction(lengths, self.batch_size, self.seed)  # the samples in their order, unpacked
        after = padding_fraction(self.train_set.row_lengths(), self.batch_size, self.seed)
        rank_zero_info(
            f"TextDataModule(packing=True): {len(train)} training samples in {len(self.train_set)} rows of"
            f" seq_len={self.seq_len}; padding {before:.1%} of the batch tokens without packing, {after:.1%} with."
        )

    def _samples(self, sources: list[Source], splits: tuple[str, ...], argument: str) -> list[SourceRows]:
        """Every source's samples and ``text`` records, in order, before any block is cut (``record_split``): a list
        for ``.txt``/``.jsonl``, Arrow-backed rows for datasets."""
        parts: list[SourceRows] = []
        for source in sources:
            if source.kind == "native":
                report = FileReport(source.path)
                parts.append(self._file_samples(source, report))
            else:
                rows, report = self._dataset_samples(source, splits, argument)
                parts.append(rows)
            self.reports.append(report)
            # a dataset's columns are checked before it is read; a file's once read: before its line, which would
            # count every record as unusable where a mapping names a column it lacks, or no column is known
            if source.kind == "native" and (self.fields is not None or (report.used == 0 and report.columns)):
                check_columns(report.columns, self.fields, str(report.path))
            rank_zero_info(report.describe())
            notes, inside_token = report.describe_notes(), report.describe_inside_token()
            if notes:
                rank_zero_info(notes)
            if inside_token:
                rank_zero_warn(inside_token)
            unread = unread_columns(report.columns, self.fields)
            if unread:
                rank_zero_info(f"{report.path}: fields={self.fields} leaves the columns {unread} unread.")
            if report.used == 0:
                raise ValueError(f"No usable record in {report.describe()}.")
            self._check_skipped(report)
            self._check_truncation(report)
        return parts

    def _file_samples(self, source: Source, report: FileReport) -> SourceRows:
        """A ``.txt`` or ``.jsonl`` file's samples and ``text`` records as tensors."""
        samples, documents = self._encode_records(read_records(source.path, report), report)
        rows = [{"input_ids": torch.tensor(s.input_ids), "labels": torch.tensor(s.labels)} for s in samples]
        return SourceRows(rows, DocumentList([torch.tensor(d) for d in documents]))

    def _dataset_samples(self, source: Source, splits: tuple[str, ...], argument: str) -> tuple[SourceRows, FileReport]:
        """A dataset's samples and ``text`` records from a memory-mapped Arrow table, and its report. Under
        DDP/FSDP the node's first process tokenizes it, the others read its table and take its report
        (``once_per_node``): the same rows as each tokenizing its own, once per node."""
        path, report = once_per_node(self.trainer, lambda: self._tokenized_table(source, splits, argument))
        rows = TokenRows(read_table(path))
        return SourceRows(rows, rows.documents()), report

    def _tokenized_table(self, source: Source, splits: tuple[str, ...], argument: str) -> tuple[str, FileReport]:
        """A dataset tokenized by ``Dataset.map`` into an Arrow table: its file, and the dataset's report."""
        dataset, label = open_dataset(source, splits, argument, read_columns=columns_read(self.fields))
        report = FileReport(label, unit="row indices")
        report.columns.update(dataset.column_names)
        check_columns(report.columns, self.fields, str(report.path))
        table = tokenize(dataset, lambda records: self._encode_records(records, report), str(report.path))
        return table_path(table), report

    def _blocks(self, documents: Documents) -> Sequence[Row]:
        """The ``seq_len`` blocks of ``text`` records, each knowing where its records start: a list for records in
        memory, a view that cuts each block when read for records in an Arrow table."""
        blocks = TextBlocks(documents, self.seq_len, self.packing)
        if self.join_text is None:  # the warning's count (``_warn_text_cut``)
            self.text_records_cut += blocks.records_cut()
        return [blocks[i] for i in range(len(blocks))] if isinstance(documents, DocumentList) else blocks

    def _encode_records(
        self, records: Iterable[tuple[int, dict[str, Any]]], report: FileReport
    ) -> tuple[list[Sample], list[list[int]]]:
        """The one record → tokens step of every source: its prompt/completion and chat samples, and its ``text``
        records' tokens (each ending with EOS), in order; unusable records are counted in ``report``."""
        samples: list[Sample] = []
        documents: list[list[int]] = []
        for number, record in records:
            report.columns.update(record)
            try:
                sample_or_reason = self._encode(read_fields(record, self.fields), record, report)
            except UnusableChatRecord as unusable:  # the template refuses it: counted, as a record with no answer
                sample_or_reason = unusable.reason
            except (ChatTemplateMismatch, NoChatTemplate, TemplateFieldError, NoTurnEnd) as problem:
                where = f"line {number}" if report.unit == "lines" else f"row {number}"
                said = self._no_template(record) if isinstance(problem, NoChatTemplate) else problem
                raise ValueError(f"{report.path}, {where}: {said}") from None
            if isinstance(sample_or_reason, str):
                report.reject(sample_or_reason, number)
                continue
            report.used += 1
            if isinstance(sample_or_reason, list):
                documents.append(sample_or_reason)
            else:
                samples.append(sample_or_reason)
        return samples, documents

    def _check_skipped(self, report: FileReport) -> None:
        """A file more than ``max_skipped_fraction`` of whose records are unusable is refused: training on the rest
        would lose them with one log line (half a file whose answers are under another name). Records whose
        targets ``seq_len`` cuts away are left to ``max_truncated_fraction``, which counts their tokens lost."""
        skipped = sum(n for reason, n in report.bad.items() if reason != self._cut_away())
        share = skipped / (sum(report.bad.values()) + report.used)
        if share <= self.max_skipped_fraction:
            return
        raise ValueError(
            f"{report.describe()}. That is {skipped} unusable records, {share:.1%} of the file's, more than"
            f" max_skipped_fraction={self.max_skipped_fraction}: training would go on without them. Fix those"
            " records as each reason says, or accept the loss with --data.max_skipped_fraction"
            f" {min(1.0, round(share + 0.005, 2))}."
        )

    def _cut_away(self) -> str:
        """The reason of a record with no target token within ``seq_len``."""
        return f"records with no target tokens within seq_len={self.seq_len}"

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

    def _encode(self, record: dict[str, Any], given: dict[str, Any], report: FileReport) -> Sample | list[int] | str:
        """A sample, a token stream to pack (text), or the reason the record is unusable (in the terms of
        ``given``, the record before the field mapping)."""
        kind = record_kind(record)
        if kind is None:
            return "records without a 'text', 'prompt'/'completion' or 'messages' field"
        if kind == "text":
            if not isinstance(record["text"], str) or not record["text"].strip():
                return "records with empty text"
            ids = encode_text(self.tokenizer, record["text"], report)
            if self.join_text is not False:
                return ids
            sample = Sample(ids, list(ids))  # every token a target, as a record of its own
        elif kind == "prompt_completion":
            prompt, completion = record.get("prompt"), record.get("completion")
            if prompt is None or completion is None:
                return missing_field_reason("completion" if completion is None else "prompt", given, self.fields)
            if isinstance(prompt, list) and isinstance(completion, list):
                problem = turns_problem(prompt) or turns_problem(completion)
                if problem:
                    return f"records whose 'prompt' or 'completion' list is not of {{role, content}} turns ({problem})"
                empty = empty_answer_reason(completion, self.tokenizer.eos_token)
                if empty:
                    return empty
                sample = self._eos_once(self._chat(record).encode_completion(prompt, completion), report)
            elif not isinstance(prompt, str) or not isinstance(completion, str):
                return mixed_prompt_completion_reason(prompt, completion)
            elif not completion.strip():
                return "records with an empty completion"
            else:
                sample = encode_prompt_completion(self.tokenizer, prompt, completion, report)
        else:
            problem = turns_problem(record["messages"])
            if problem:
                return f"records whose 'messages' is not a list of {{role, content}} turns ({problem})"
            turns = record["messages"]
            no_answer = no_answer_reason(turns) or empty_answer_reason(turns, self.tokenizer.eos_token)
            if no_answer:
                return no_answer
            sample = self._eos_once(self._chat(record).encode_messages(record["messages"]), report)
        report.count_targets(sample.labels, self.seq_len)
        sample = Sample(sample.input_ids[: self.seq_len], sample.labels[: self.seq_len])
        if all(label == IGNORE_INDEX for label in sample.labels[1:]):
            return self._cut_away()
        return sample

    def _eos_once(self, sample: Sample, report: FileReport) -> Sample:
        """A chat sample whose answer ends with the EOS the template writes too, with that EOS trained once."""
        sample, doubled = without_doubled_eos(sample, self.tokenizer.eos_token_id)
        if doubled:
            report.note(
                f"records whose assistant turn ends with the EOS {self.tokenizer.eos_token!r} that the chat template"
                " writes after it too, not trained a second time"
            )
        return sample

    def _chat(self, record: dict[str, Any]) -> ChatTemplate:
        if self.tokenizer.chat_template is None:
            raise NoChatTemplate
        return ChatTemplate.for_record(self.tokenizer, record, self.chat_template_kwargs, self.eos_after_turns)

    def _no_template(self, record: dict[str, Any]) -> str:
        """Why a chat record cannot be read with this tokenizer, in the record's own terms, and the two fixes."""
        if self.fields is None and all(column in record for column in ALPACA_COLUMNS):
            what, strings = "alpaca records (instruction, output) are read as chat turns, which need", ALPACA_STRINGS
        elif self.fields is None and SHAREGPT_COLUMN in record:
            what, strings = "ShareGPT records (conversations) are chat turns, which need", None
        elif "messages" in read_fields(record, self.fields):
            what, strings = "'messages' records are chat turns, which need", None
        else:
            what, strings = "prompt/completion lists of turns need", None
        instead = f"; records without an input read as prompt/completion strings with --data.fields '{strings}'"
        instead = instead if strings else ""
        return (
            f"{what} a chat template, and the tokenizer in {self.tokenizer_dir!r} has none. Use a chat model's"
            f" tokenizer (--data.tokenizer){instead}."
        )

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

    def longest_train_row(self) -> int:
        """The longest row a training batch can hold (each is padded to its longest): what memory is sized for
        (``memory.sizing_batch``). Packed, a later epoch packs anew: up to ``seq_len`` where the samples fill it."""
        if self.train_set is None:
            raise RuntimeError("TextDataModule.longest_train_row() needs setup('fit') first.")
        if isinstance(self.train_set, PackedRows):
            packed = min(self.seq_len, sum(self.train_set.lengths))
            return max([packed, *self.train_set.ready_lengths])
        return max(row_lengths(self.train_set), default=0)

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


def mixed_prompt_completion_reason(prompt: Any, completion: Any) -> str:
    """Why a prompt/completion record of other types is unusable, naming them: a Parquet column of numbers (an
    answer ``42``) was told only "not both strings"."""
    reason = (
        "records with 'prompt' and 'completion' not both strings or both lists of turns"
        f" (prompt: {type(prompt).__name__}, completion: {type(completion).__name__}"
    )
    if any(isinstance(value, (int, float)) for value in (prompt, completion)):
        return reason + "): a number is not text; store that column as strings"
    return reason + ")"


class NoChatTemplate(ValueError):
    """A chat record, and a tokenizer without a chat template (``_no_template`` words it for the record)."""


ALPACA_STRINGS = "{prompt: instruction, completion: output}"  # an input would be left out: not offered for those


def packed_rows(samples: Sequence[Row], seq_len: int, seed: int, lengths: list[int] | None = None) -> PackedRows:
    """``text`` rows (which carry ``position_ids`` already) as they are; the other samples packed. Reads no row of
    an Arrow table (``row_facts``). ``lengths``: the samples' token counts, where the caller has them already."""
    flags = ready_rows(samples)
    lengths = row_lengths(samples) if lengths is None else lengths
    ready = [i for i, flag in enumerate(flags) if flag]
    others = [i for i, flag in enumerate(flags) if not flag]
    return PackedRows(
        subset(samples, others),
        seq_len,
        seed,
        ready=subset(samples, ready),
        lengths=[lengths[i] for i in others],
        ready_lengths=[lengths[i] for i in ready],
    )
