"""Memory sizes as people write them (``"24GiB"``, ``"24GB"``, ``"512MiB"``, ``"1.5 GiB"`` or a byte count), and
as the package prints them."""

from __future__ import annotations

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
        if value > 0:
            return int(value)
        raise ValueError(_message(value, argument))
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(value))
    if match is None or match.group(2).lower() not in UNITS or float(match.group(1)) <= 0:
        raise ValueError(_message(value, argument))
    return int(float(match.group(1)) * UNITS[match.group(2).lower()])


def _message(value: object, argument: str) -> str:
    return (
        f"{argument}={value!r} is not a memory size: give a positive number of bytes or a number with a unit, such"
        " as 24GiB, 80GB or 512MiB (GiB = 2**30 bytes, GB = 10**9, as GPU makers count)."
    )


def format_bytes(nbytes: int) -> str:
    """Bytes as a person reads them: GiB from 1 GiB up, else MiB while two decimals show a figure (0.01 MiB up),
    then KiB, then bytes: a budget of 1 KiB is "1.00 KiB", not "0.00 MiB"."""
    size = abs(nbytes)
    if size >= 2**30:
        return f"{nbytes / 2**30:.2f} GiB"
    if size >= 0.01 * 2**20:
        return f"{nbytes / 2**20:.2f} MiB"
    if size >= 2**10:
        return f"{nbytes / 2**10:.2f} KiB"
    return f"{nbytes} bytes"
