"""``pl-lowprec estimate --json``: stdout is one JSON object a script reads (``json.loads`` of all of it), with the
figures the table prints (the table and every other line on stderr). Before, the estimate was a table for a
person only, which a script had to scrape."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from pl_lowprec.cli import main

pytest.importorskip("peft")
pytest.importorskip("bitsandbytes")

QUICKSTART = str(Path(__file__).resolve().parents[2] / "configs/quickstart.yaml")


def test_estimate_json_is_all_of_stdout_and_holds_the_tables_figures(capsys):
    main(["estimate", "--config", QUICKSTART, "--json"])
    out, err = capsys.readouterr()
    record = json.loads(out)  # nothing else on stdout
    peak = int(re.search(r"PEAK [0-9.]+ MiB \(([0-9,]+) bytes\)", err)[1].replace(",", ""))
    assert record["peak_bytes"] == peak > 0
    assert record["peak_phase"] in err
    trainable = int(re.search(r"([0-9,]+) trainable", err)[1].replace(",", ""))
    assert record["trainable_parameters"] == trainable
    assert record["components_bytes"]["gradients"] > 0 and record["step_seconds"] > 0
    assert record["notes"][0] == "Batch: 8 rows x 128 positions, the longest batch the training data makes."
