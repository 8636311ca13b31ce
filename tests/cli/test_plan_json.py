"""``pl-lowprec plan --json``: stdout is one JSON object a script reads (``json.loads`` of all of it), with the plan
the table prints and the chosen candidate's estimate under ``estimate --json``'s names (the table and every other
line on stderr). Before, the plan was a table for a person only."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

from pl_lowprec.cli import main

pytest.importorskip("peft")
pytest.importorskip("bitsandbytes")

QUICKSTART = str(Path(__file__).resolve().parents[2] / "configs/quickstart.yaml")


def test_plan_json_is_all_of_stdout_and_holds_the_tables_choice(capsys, tmp_path):
    out = tmp_path / "plan.yaml"
    main(["plan", f"--config={QUICKSTART}", "--memory=64MiB", f"--out={out}", "--json"])
    printed, err = capsys.readouterr()
    record = json.loads(printed)  # nothing else on stdout
    assert "Budget 64.00 MiB, margin 10%" in err and f"Wrote {out}" in err
    assert record["budget_bytes"] == 64 * 2**20 and record["limit_bytes"] == int(64 * 2**20 * 0.9)
    chosen = record["chosen"]
    table_peak = float(re.search(r"^\* yes +(?P<peak>[0-9.]+) ", err, re.MULTILINE)["peak"])
    assert chosen["fits"] and chosen["peak_bytes"] / 2**20 == pytest.approx(table_peak, abs=0.0006)
    assert chosen["settings"]["described"] in re.search(r"^Chosen: (.*)$", err, re.MULTILINE)[1]
    assert record["chosen_estimate"]["peak_bytes"] == chosen["peak_bytes"]  # estimate --json's record
    assert record["chosen_estimate"]["components_bytes"]["gradients"] > 0
    assert record["candidates"][0] == chosen and len(record["candidates"]) > 1
    assert record["out"] == str(out)
    planned = yaml.safe_load(out.read_text())
    assert planned["trainer"]["accumulate_grad_batches"] == chosen["settings"]["accumulate_grad_batches"]
    assert planned["data"]["init_args"]["batch_size"] == chosen["settings"]["micro_batch"]


def test_plan_json_when_nothing_fits_says_so_and_exits_1(capsys):
    with pytest.raises(SystemExit) as exited:
        main(
            ["plan", f"--config={QUICKSTART}", "--memory=1MiB", "--json", "--data.init_args.batch_size=1"]
        )  # 10 candidates
    printed, err = capsys.readouterr()
    assert exited.value.code == 1
    record = json.loads(printed)
    assert record["chosen"] is None and record["out"] is None and not any(c["fits"] for c in record["candidates"])
    assert "Nothing fits in" in err


def test_plan_json_of_maximize_is_the_largest_value_that_fits(capsys):
    main(["plan", f"--config={QUICKSTART}", "--memory=64MiB", "--maximize=batch_size", "--json"])
    printed, err = capsys.readouterr()
    record = json.loads(printed)
    said = re.search(r"^Largest batch_size that fits in .*: (\d+)", err, re.MULTILINE)
    assert record["maximize"] == "batch_size" and record["largest"] == int(said[1]) >= 1
    assert record["out"] is None and record["settings"]["described"] in err
