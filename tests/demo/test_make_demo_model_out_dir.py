"""make-demo-model writes over nothing it did not write, and over an earlier demo only with --overwrite."""

import pytest

from pl_lowprec.cli import main
from pl_lowprec.demo.pretrained import make_demo_model

pytest.importorskip("transformers")

TINY = {"steps": 1, "hidden_size": 32, "num_layers": 1, "vocab_size": 260, "max_bytes": 20_000, "seq_len": 16}


def snapshot(directory):
    return {p: p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


def test_an_earlier_demo_is_replaced_only_with_overwrite(tmp_path, capsys):
    make_demo_model(tmp_path, **TINY)
    before = snapshot(tmp_path)
    with pytest.raises(SystemExit) as exit_info:
        main(["make-demo-model", str(tmp_path), "--steps", "1"])
    assert exit_info.value.code == 2
    assert "holds an earlier demo (make-demo-model wrote it): pass --overwrite" in capsys.readouterr().err
    assert snapshot(tmp_path) == before
    (tmp_path / "model" / "stale.safetensors").write_bytes(b"old shard")
    make_demo_model(tmp_path, **{**TINY, "seed": 1}, overwrite=True)
    assert not (tmp_path / "model" / "stale.safetensors").exists()  # nothing of the earlier demo stays
    assert (tmp_path / "model" / "config.json").is_file() and (tmp_path / "data" / "train.jsonl").is_file()


@pytest.mark.parametrize("part", ["model", "data"])
def test_files_it_did_not_write_are_never_replaced(tmp_path, part):
    (tmp_path / part).mkdir()
    (tmp_path / part / "mine.jsonl").write_text('{"text": "my own records"}\n')
    before = snapshot(tmp_path)
    with pytest.raises(ValueError, match=rf"{part} holds files make-demo-model did not write.*not even with"):
        make_demo_model(tmp_path, **TINY, overwrite=True)
    assert snapshot(tmp_path) == before
