"""``pl-lowprec generate`` says how many completions came out empty: a model that ends every completion at once
(an end-of-sequence token first: a chat template or EOS the fine-tune got wrong) wrote a file of "" and the line
"Wrote 2 completions", nothing more. Run the user's way (``pl_lowprec.cli.main``) on a model directory, the decoding
replaced by one that ends each completion at once (the model's own first tokens are random)."""

from __future__ import annotations

import json

import pytest
from loading_helpers import save_pretrained_dir

from pl_lowprec.cli import main

pytest.importorskip("transformers")


def test_empty_completions_are_counted_with_their_likely_causes(tmp_path, capsys, monkeypatch):
    model = save_pretrained_dir(tmp_path / "model")
    monkeypatch.setattr(
        "pl_lowprec.export.generate.Generator.complete_ids", lambda self, prompts, *args, **kw: [""] * len(prompts)
    )
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("def f(x):\nclass A:\n")
    out = tmp_path / "completions.jsonl"
    main(["generate", f"--model={model}", f"--prompts={prompts}", f"--out={out}", "--max_new_tokens=3"])
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [row["completion"] for row in rows] == ["", ""]
    said = capsys.readouterr().out
    assert f"Wrote 2 completions to {out}. 2 of 2 are empty: the model ended them at once" in said, said
