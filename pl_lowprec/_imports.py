"""Optional dependencies, checked in one place so that a missing extra fails early with the install command."""

from __future__ import annotations

from functools import lru_cache
from types import ModuleType

from lightning_utilities.core.imports import RequirementCache

_JSONARGPARSE = RequirementCache("jsonargparse[signatures]>=4.27")
_BITSANDBYTES = RequirementCache("bitsandbytes>=0.45")
_PEFT = RequirementCache("peft>=0.13")
_SAFETENSORS = RequirementCache("safetensors>=0.4")
_TORCHAO = RequirementCache("torchao>=0.16")


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
def import_torchao_nf4() -> ModuleType:
    """torchao's NF4 tensor module (sharded 4-bit weights), or an error naming the feature and the install command."""
    if not _TORCHAO:
        raise ModuleNotFoundError(
            f"quantization= under strategy='lowprec_fsdp' stores 4-bit weights as torchao NF4 tensors, which shard:"
            f' {_TORCHAO.message}. Install it with: pip install "pl_lowprec[fsdp]"'
        )
    from torchao.quantization.quantize_.workflows.nf4 import nf4_tensor

    return nf4_tensor
