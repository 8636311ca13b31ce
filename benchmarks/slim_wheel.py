"""A wheel without the files a GPU call does not use, so that the carried wheels fit one call's 64 MiB; the RECORD
is rewritten with the kept files' hashes, in place.

bitsandbytes with only one CUDA version's library (the GPU machine's torch 2.11.0+cu130 loads
libbitsandbytes_cuda130.so), 43 MB to 4 MB:
    python benchmarks/slim_wheel.py .whl/bitsandbytes-0.50.2-py3-none-manylinux_2_24_x86_64.whl --cuda 130
Unsloth without its web app (``studio/``, which neither unsloth nor unsloth_zoo imports), 28.6 MB to 2.2 MB:
    python benchmarks/slim_wheel.py .whl_unsloth/unsloth-2026.10.9-py3-none-any.whl --drop '^studio/'
"""

from __future__ import annotations

import argparse
import base64
import csv
import hashlib
import io
import re
import zipfile
from pathlib import Path


def slim(wheel: Path, drop: re.Pattern[str]) -> int:
    """Rewrites ``wheel`` without the files whose names match ``drop``; returns its new size in bytes."""
    with zipfile.ZipFile(wheel) as source:
        files = {n: source.read(n) for n in source.namelist() if not drop.search(n)}
    record = next(n for n in files if n.endswith(".dist-info/RECORD"))
    rows = []
    for name, data in files.items():
        if name != record:
            digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
            rows.append((name, f"sha256={digest}", str(len(data))))
    text = io.StringIO()
    csv.writer(text, lineterminator="\n").writerows([*rows, (record, "", "")])
    files[record] = text.getvalue().encode()
    with zipfile.ZipFile(wheel, "w", zipfile.ZIP_DEFLATED) as target:
        for name, data in files.items():
            target.writestr(name, data)
    return wheel.stat().st_size


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("wheel", type=Path)
    which = parser.add_mutually_exclusive_group(required=True)
    which.add_argument("--cuda", help="bitsandbytes: the CUDA version whose library stays (130 for CUDA 13.0)")
    which.add_argument("--drop", help="a regular expression: the files whose names match it go")
    args = parser.parse_args()
    drop = args.drop or rf"libbitsandbytes_(cuda(?!{args.cuda}\.)\d+|rocm\d+)\.so$"
    print(f"{args.wheel}: {slim(args.wheel, re.compile(drop)) / 1e6:.1f} MB")
