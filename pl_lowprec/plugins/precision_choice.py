"""What ``precision="auto"`` resolves to on a given device, and why.

The fast choice depends on the hardware, and the wrong one costs a factor of several with no error:
bf16 autocast on a CPU without native bf16 (AVX2-only EPYCs, older Xeons) runs several times slower than
fp32, and a GPU without bf16 (T4, V100) needs fp16 with loss scaling instead. The rule:

- CUDA with bf16 (compute capability 8.0+)  -> ``"bf16-mixed"``
- CUDA without bf16                          -> ``"16-mixed"`` (fp16 autocast with dynamic loss scaling)
- CPU with AMX or avx512_bf16                -> ``"bf16-mixed"``
- CPU without either                         -> ``"32-true"`` (no autocast)

Capabilities come from what torch reports (``torch.cuda.is_bf16_supported``, ``torch.cpu``'s ISA checks), so
tests patch those functions to cover every branch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

ResolvedPrecision = Literal["bf16-mixed", "16-mixed", "32-true"]


@dataclass(frozen=True)
class PrecisionChoice:
    """The precision ``"auto"`` chose for a device, with the capability that decided it."""

    precision: ResolvedPrecision
    device: str
    reason: str

    def describe(self) -> str:
        what = {
            "bf16-mixed": "'bf16-mixed' (bf16 autocast)",
            "16-mixed": "'16-mixed' (fp16 autocast with dynamic loss scaling)",
            "32-true": "'32-true' (fp32, no autocast)",
        }[self.precision]
        return f"AMPPrecision('auto') chose {what} on {self.device}: {self.reason}"


def cpu_native_bf16() -> tuple[bool, str]:
    """Whether this CPU computes bf16 natively (AMX or avx512_bf16), and what torch reported."""
    amx = _cpu_check("_is_amx_tile_supported")
    avx512_bf16 = _cpu_check("_is_avx512_bf16_supported")
    capability = torch.backends.cpu.get_cpu_capability()
    found = [name for name, present in (("AMX", amx), ("avx512_bf16", avx512_bf16)) if present]
    if found:
        return True, f"the CPU has {' and '.join(found)} (torch capability {capability})"
    return False, f"the CPU has neither AMX nor avx512_bf16 (torch capability {capability})"


def choose_precision(device: torch.device | str) -> PrecisionChoice:
    """The fastest sound mixed-precision setting for ``device``."""
    device = torch.device(device)
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        major, minor = torch.cuda.get_device_capability(device)
        if torch.cuda.is_bf16_supported():
            return PrecisionChoice("bf16-mixed", f"cuda ({name})", f"compute capability {major}.{minor} has bf16.")
        return PrecisionChoice(
            "16-mixed",
            f"cuda ({name})",
            f"compute capability {major}.{minor} has no bf16 (it needs 8.0+), so fp16 with loss scaling.",
        )
    if device.type == "cpu":
        native, found = cpu_native_bf16()
        if native:
            return PrecisionChoice("bf16-mixed", "cpu", f"{found}, which computes bf16 natively.")
        return PrecisionChoice(
            "32-true",
            "cpu",
            f"{found}; bf16 autocast is emulated there and runs several times slower than fp32."
            " Pass precision='bf16-mixed' to use it anyway.",
        )
    raise ValueError(
        f"AMPPrecision('auto') cannot choose for device type {device.type!r}: it knows 'cuda' and 'cpu'."
        " Pass precision='16-mixed' or 'bf16-mixed' explicitly."
    )


def cpu_fp16_note() -> str | None:
    """What to say when ``"16-mixed"`` was asked for on this CPU: fp16 autocast is right there (loss scaling with
    ``GradScaler("cpu")``) but an order of magnitude slower than fp32 without native fp16 (AMX-FP16). ``None``
    where torch reports AMX-FP16."""
    if _cpu_check("_is_amx_fp16_supported"):
        return None
    auto = choose_precision("cpu").precision
    return (
        "AMPPrecision('16-mixed') on cpu runs real fp16 autocast: the numbers are fp16's with loss scaling, but a"
        " CPU without AMX-FP16 computes fp16 slowly (11-17x slower than fp32 for matmul-bound layers on the AMD"
        f" EPYC of docs/precision.md). For speed pass precision='auto', which chooses {auto!r} on this CPU"
        " ('bf16-mixed' where the CPU has AMX or avx512_bf16, else fp32); keep '16-mixed' on CPU to check fp16"
        " numerics before a GPU run."
    )


def _cpu_check(name: str) -> bool:
    """Call one of ``torch.cpu``'s ISA checks; a torch without it reports nothing (False)."""
    check = getattr(torch.cpu, name, None)
    return bool(check()) if check is not None else False
