"""Data modules for causal-LM fine-tuning; training loaders resume mid-epoch exactly."""

from pl_lowprec.data.resumable import ResumableDataLoader, ResumableSampler, resumable_loader

__all__ = ["ResumableDataLoader", "ResumableSampler", "resumable_loader"]
