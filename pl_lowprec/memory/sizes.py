"""Memory sizes as people write them (``"24GiB"``, ``"24GB"``, ``"512MiB"``, ``"1.5 GiB"`` or a byte count), and
as the package prints them."""

from __future__ import annotations

import math
import re

UNITS = {
    "": 1,
    "b": 1,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
}


def parse_bytes(value: int | float | str, argument: str = "memory") -> int:
    """Bytes from an int or a string with a unit (binary GiB/MiB, decimal GB/MB); a clear error otherwise."""
    if isinstance(value, bool):
        raise ValueError(_message(value, argument))
    if isinstance(value, (int, float)):
        nbytes = int(value) if math.isfinite(value) else 0
    else:
        match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(value))
        if match is None or match.group(2).lower() not in UNITS:
            raise ValueError(_message(value, argument))
        nbytes = int(float(match.group(1)) * UNITS[match.group(2).lower()])
    if nbytes < 1:  # 0.5 or "0.9 B" is under a byte: no budget at all, not a 0-byte one
        raise ValueError(_message(value, argument))
    return nbytes


def _message(value: object, argument: str) -> str:
    return (
        f"{argument}={value!r} is not a memory size: give a number of bytes (at least 1) or a number with a unit,"
        " such as 24GiB, 80GB or 512MiB (GiB = 2**30 bytes, GB = 10**9, as GPU makers count)."
    )


def _unit(size: int) -> tuple[int, str]:
    """GiB from 1 GiB up, else MiB while two decimals show a figure (0.01 MiB up), then KiB, then bytes."""
    if size >= 2**30:
        return 2**30, "GiB"
    if size >= 0.01 * 2**20:
        return 2**20, "MiB"
    if size >= 2**10:
        return 2**10, "KiB"
    return 1, "bytes"


def format_bytes(nbytes: int) -> str:
    """Bytes as a person reads them (``_unit``): a budget of 1 KiB is "1.00 KiB", not "0.00 MiB"."""
    divisor, unit = _unit(abs(nbytes))
    return f"{nbytes} bytes" if divisor == 1 else f"{nbytes / divisor:.2f} {unit}"


def format_bytes_at_least(nbytes: int) -> str:
    """``format_bytes`` rounded up, for a memory that must be at least ``nbytes``: 1.001 GiB is "1.01 GiB"."""
    divisor, unit = _unit(abs(nbytes))
    return f"{nbytes} bytes" if divisor == 1 else f"{math.ceil(nbytes / divisor * 100) / 100:.2f} {unit}"
