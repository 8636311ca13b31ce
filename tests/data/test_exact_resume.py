"""A run killed with SIGKILL mid-epoch and resumed from last.ckpt ends with the adapters of an uninterrupted run."""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import warm_python

SCRIPT = Path(__file__).parents[1] / "_scripts" / "resume_run.py"

pytest.importorskip("peft")
pytest.importorskip("transformers")


def _run(mode: str, out: Path, spec: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_DATASETS_CACHE": str(out.parent / "hf-cache")}  # load_dataset's copies: not ~/.cache
    return warm_python.run([sys.executable, str(SCRIPT), mode, str(out), spec], timeout=300, env=env)


def assert_resume_is_exact(tmp_path: Path, spec: str) -> None:
    full = _run("full", tmp_path / "full", spec)
    assert full.returncode == 0, full.stderr[-3000:]
    killed = _run("killed", tmp_path / "resumed", spec)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    assert not (tmp_path / "resumed" / "adapters.pt").exists()
    resumed = _run("resumed", tmp_path / "resumed", spec)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "not resumable" not in resumed.stderr
    expected = torch.load(tmp_path / "full" / "adapters.pt")
    got = torch.load(tmp_path / "resumed" / "adapters.pt")
    assert sorted(got) == sorted(expected) and len(got) == 14  # A and B of 7 linear layers in 1 decoder layer
    for key, value in expected.items():
        torch.testing.assert_close(got[key], value, rtol=0, atol=0, msg=key)


@pytest.mark.slow
def test_stdlib_text_resumes_exactly(tmp_path):
    assert_resume_is_exact(tmp_path, "stdlib")


@pytest.mark.slow
@pytest.mark.parametrize(
    ("suffix", "packing", "lora_dropout"),
    [(".jsonl", False, 0.0), (".jsonl", True, 0.0), (".parquet", True, 0.0), (".jsonl", False, 0.1)],
)
def test_text_datamodule_with_causal_lm_resumes_exactly(tmp_path, suffix, packing, lora_dropout):
    """From a .jsonl file, and from a Parquet file, whose samples stay in a memory-mapped Arrow table; with LoRA
    dropout, whose masks come from the random states the checkpoint keeps (``strategies/random_states.py``)."""
    from loading_helpers import save_pretrained_dir

    pretrained = save_pretrained_dir(tmp_path / "pretrained")
    rows = [{"prompt": f"def f{i}(x):\n    return", "completion": " x" + " + 1" * (i % 7)} for i in range(40)]
    if suffix == ".parquet":
        datasets = pytest.importorskip("datasets")
        datasets.Dataset.from_list(rows).to_parquet(str(tmp_path / "pc.parquet"))
    else:
        (tmp_path / "pc.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    # 36 training samples in batches of 3: 12 batches, 6 optimizer steps (accumulating 2) per epoch; packed into
    # rows of 48 tokens, 2 to 3 samples a row, repacked each epoch: the kill falls mid-epoch in a later epoch
    data = {
        "train_files": str(tmp_path / f"pc{suffix}"),
        "tokenizer": str(pretrained),
        "batch_size": 3,
        "val_fraction": 0.1,
        **({"packing": True, "seq_len": 48} if packing else {}),
    }
    spec = {"pretrained": str(pretrained), "data": data, "lora_dropout": lora_dropout}
    assert_resume_is_exact(tmp_path, json.dumps(spec))
