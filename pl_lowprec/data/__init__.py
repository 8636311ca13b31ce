"""Data modules for causal-LM fine-tuning; training loaders resume mid-epoch exactly."""

from pl_lowprec.data.collate import PadCollate
from pl_lowprec.data.resumable import ResumableDataLoader, ResumableSampler, resumable_loader
from pl_lowprec.data.text import TextDataModule

__all__ = ["PadCollate", "ResumableDataLoader", "ResumableSampler", "TextDataModule", "resumable_loader"]
