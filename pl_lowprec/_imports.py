"""Optional dependencies, checked in one place so that a missing extra fails early with the install command."""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable
from functools import lru_cache
from types import ModuleType

import torch
from lightning_utilities.core.imports import RequirementCache

_JSONARGPARSE = RequirementCache("jsonargparse[signatures]>=4.27")
_BITSANDBYTES = RequirementCache("bitsandbytes>=0.45")
_PEFT = RequirementCache("peft>=0.13")
_SAFETENSORS = RequirementCache("safetensors>=0.4")
_TORCHAO = RequirementCache("torchao>=0.18")
_MATPLOTLIB = RequirementCache("matplotlib")
_DATASETS = RequirementCache("datasets>=4.0")
_GGUF = RequirementCache("gguf>=0.19")
_LIGER = RequirementCache("liger-kernel>=0.8.5")


def require_cli() -> None:
    if not _JSONARGPARSE:
        raise ModuleNotFoundError(
            f"The pl-lowprec command line needs jsonargparse: {_JSONARGPARSE.message}."
            ' Install it with: pip install "pl_lowprec[cli]"'
        )


@lru_cache
def import_bitsandbytes() -> ModuleType:
    """bitsandbytes, or an error naming the feature and the install command."""
    if not _BITSANDBYTES:
        raise ModuleNotFoundError(
            f"quantization= and the 8-bit optimizers need bitsandbytes: {_BITSANDBYTES.message}."
            ' Install it with: pip install "pl_lowprec[qlora]"'
        )
    import bitsandbytes

    return bitsandbytes


@lru_cache
def import_peft() -> ModuleType:
    """peft, or an error naming the feature and the install command."""
    if not _PEFT:
        raise ModuleNotFoundError(
            f'lora= needs peft: {_PEFT.message}. Install it with: pip install "pl_lowprec[qlora]"'
        )
    import peft

    return peft


@lru_cache
def import_safetensors() -> ModuleType:
    """safetensors, or an error naming the feature and the install command."""
    if not _SAFETENSORS:
        raise ModuleNotFoundError(
            f'pretrained= needs safetensors: {_SAFETENSORS.message}. Install it with: pip install "pl_lowprec[hf]"'
        )
    import safetensors

    return safetensors


@lru_cache
def import_datasets() -> ModuleType:
    """Hugging Face datasets, or an error naming the feature and the install command."""
    if not _DATASETS:
        raise ModuleNotFoundError(
            "TextDataModule reads .parquet, .csv, .json and .arrow files, saved datasets, hub dataset ids and"
            f" datasets.Dataset objects through Hugging Face datasets: {_DATASETS.message}. Install it with:"
            ' pip install "pl_lowprec[datasets]" (.txt and .jsonl files need nothing more).'
        )
    import datasets

    return datasets


def import_torchao() -> ModuleType:
    """torchao, or an error naming the features and the install command."""
    if not _TORCHAO:
        raise ModuleNotFoundError(
            f'qat= and fp8= need torchao: {_TORCHAO.message}. Install it with: pip install "pl_lowprec[torchao]"'
        )
    import torchao
    import torchao.float8
    import torchao.prototype.qat  # imported lazily by QAT's prepare step: import it here, where it is expected

    return torchao


class _ImportNoise(logging.Filter):
    """Drops import-time messages of torchao 0.18 and bitsandbytes 0.50 that ask nothing of the user.

    - "Failed to load .../_C_cutlass_90a.abi3.so" (and ``_C_mxfp8``): CUDA-only kernels in torchao's wheel, which
      cannot load without a CUDA driver; the CPU paths (QAT, FP8 emulation) never call them. Dropped only when CUDA
      is absent: on a GPU machine a kernel that fails to load is a real problem and must be seen.
    - "<enum ...> is an Enum subclass and is now natively supported by torch.compile": torch 2.13 deprecating a
      registration that torchao 0.18 still makes; nothing to do for the user.
    - "Failed to load CPU gemm_4bit_forward from kernels-community": on a CPU with avx512_bf16, bitsandbytes tries
      to fetch an optional 4-bit kernel from the Hugging Face Hub (the ``kernels`` package) at import, and falls
      back to the kernel in its own wheel, which runs. Its advice, ``pip install kernels``, would download code at
      import time, which offline machines cannot and this package never does.
    """

    def __init__(self, cuda_available: bool) -> None:
        super().__init__()
        self.cuda_available = cuda_available

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if record.name.startswith("bitsandbytes"):
            return not message.startswith("Failed to load CPU gemm_4bit_forward from kernels-community")
        if "is an Enum subclass and is now natively supported" in message:
            return False
        return self.cuda_available or not message.startswith("Failed to load")


NOISY_LOGGERS = ("torchao", "torch.utils._pytree", "bitsandbytes.backends.cpu.ops")


def filter_import_noise() -> None:
    """Drop torchao's and bitsandbytes' import-time noise for good (idempotent). Called when ``pl_lowprec`` is
    imported, because transformers and peft import them whenever they are installed, long before this package's
    own imports of them run. Also Lightning 2.6's warning, on every fit, that torch deprecates ``LeafSpec``: it is
    Lightning's own call (``lightning/pytorch/utilities/_pytree.py``), with nothing for the user to change."""
    for name in NOISY_LOGGERS:
        logger = logging.getLogger(name)
        if not any(isinstance(f, _ImportNoise) for f in logger.filters):
            logger.addFilter(_ImportNoise(torch.cuda.is_available()))
    warnings.filterwarnings(
        "ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated", category=FutureWarning
    )


@lru_cache
def import_torchao_nf4() -> ModuleType:
    """torchao's NF4 tensor module (sharded 4-bit weights), or an error naming the feature and the install command."""
    if not _TORCHAO:
        raise ModuleNotFoundError(
            f"quantization= under strategy='lowprec_fsdp' stores 4-bit weights as torchao NF4 tensors, which shard:"
            f' {_TORCHAO.message}. Install it with: pip install "pl_lowprec[fsdp]"'
        )
    from torchao.quantization.quantize_.workflows.nf4 import nf4_tensor

    return nf4_tensor


@lru_cache
def import_matplotlib_pyplot() -> ModuleType:
    """matplotlib's pyplot (without a display), or an error naming the feature and the install command."""
    if not _MATPLOTLIB:
        raise ModuleNotFoundError(
            f'estimate --plot needs matplotlib: {_MATPLOTLIB.message}. Install it with: pip install "pl_lowprec[plot]"'
        )
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot

    return matplotlib.pyplot


GGUF_INSTALL = 'pip install "pl_lowprec[gguf]"'


def gguf_missing() -> str | None:
    """Why ``--format gguf`` cannot run here (the ``gguf`` package is absent or too old), or None."""
    return None if _GGUF else f"{_GGUF.message}. Install it with: {GGUF_INSTALL}"


@lru_cache
def import_gguf() -> ModuleType:
    """llama.cpp's ``gguf`` package (the GGUF writer and quantizers), or an error with the install command."""
    missing = gguf_missing()
    if missing is not None:
        raise ModuleNotFoundError(f"pl-lowprec export --format gguf needs the gguf package: {missing}")
    import gguf

    return gguf


@lru_cache
def import_liger_fused_linear_cross_entropy() -> Callable[..., torch.Tensor]:
    """Liger-Kernel's functional fused linear cross-entropy, or an error naming the feature and the install command
    (Liger's kernels are Triton: installed with CUDA builds of torch, not with CPU ones)."""
    problem = liger_missing()
    if problem:
        raise ModuleNotFoundError(problem)
    from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy

    return liger_fused_linear_cross_entropy


def liger_missing() -> str | None:
    """Why Liger-Kernel cannot be imported (a sentence with the install command), or ``None``."""
    if not _LIGER:
        return f'Liger-Kernel is not installed ({_LIGER.message}); install it with: pip install "pl_lowprec[liger]"'
    try:
        import liger_kernel.transformers.functional  # noqa: F401
    except ImportError as err:
        return f"Liger-Kernel is installed but does not import ({err}); it needs Triton, which CUDA torch builds bring"
    return None
