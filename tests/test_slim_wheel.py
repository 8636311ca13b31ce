"""benchmarks/slim_wheel.py: the wheels carried to a GPU machine lose only the files named, and keep a RECORD pip
accepts (every kept file with its hash), so that they install there."""

import base64
import csv
import hashlib
import importlib.util
import io
import re
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _slim_module():
    spec = importlib.util.spec_from_file_location("slim_wheel", ROOT / "benchmarks" / "slim_wheel.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _digest(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def test_only_the_named_libraries_go_and_the_record_lists_the_rest_with_their_hashes(tmp_path):
    wheel = tmp_path / "bitsandbytes-0.50.2-py3-none-any.whl"
    files = {
        "bitsandbytes/__init__.py": b"x = 1\n",
        "bitsandbytes/libbitsandbytes_cuda128.so": b"\0" * 64,
        "bitsandbytes/libbitsandbytes_cuda130.so": b"\1" * 64,
        "bitsandbytes/libbitsandbytes_rocm72.so": b"\2" * 64,
        "bitsandbytes/libbitsandbytes_cpu.so": b"\3" * 64,
        "bitsandbytes-0.50.2.dist-info/RECORD": b"stale\n",
    }
    with zipfile.ZipFile(wheel, "w") as archive:
        for name, data in files.items():
            archive.writestr(name, data)

    slim = _slim_module()
    slim.slim(wheel, re.compile(r"libbitsandbytes_(cuda(?!130\.)\d+|rocm\d+)\.so$"))

    with zipfile.ZipFile(wheel) as archive:
        kept = {name: archive.read(name) for name in archive.namelist()}
    assert sorted(kept) == [
        "bitsandbytes-0.50.2.dist-info/RECORD",
        "bitsandbytes/__init__.py",
        "bitsandbytes/libbitsandbytes_cpu.so",
        "bitsandbytes/libbitsandbytes_cuda130.so",
    ]
    record = list(csv.reader(io.StringIO(kept["bitsandbytes-0.50.2.dist-info/RECORD"].decode())))
    listed = {row[0]: row[1:] for row in record}
    assert listed.pop("bitsandbytes-0.50.2.dist-info/RECORD") == ["", ""]
    assert listed == {name: [_digest(data), str(len(data))] for name, data in kept.items() if "RECORD" not in name}
