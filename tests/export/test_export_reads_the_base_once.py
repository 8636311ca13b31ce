"""``pl-lowprec export --ckpt_path`` of a run on a pytorch_model.bin base: the restore's load and the merge each
unpickled every shard (twice in all); they share the mapping now, and the merged files are those of the same
weights given as safetensors."""

from __future__ import annotations

import pytest
import torch
from gguf_helpers import fit_args, fitted_checkpoint
from loading_helpers import bin_copy, count_unpickles, save_pretrained_dir, write_prompt_completion

from pl_lowprec.cli import main
from pl_lowprec.loading.sources import checkpoint_files

pytest.importorskip("transformers")
pytest.importorskip("peft")


def _args(pretrained, data, root) -> list[str]:
    """The shipped config's fit, LoRA without quantization (the merge then reads the base's weights)."""
    return [*fit_args(pretrained, data, root), "--trainer.strategy.init_args.quantization=null"]


def _tensors(directory) -> dict:
    from safetensors.torch import load_file

    return {key: value for f in sorted(directory.glob("*.safetensors")) for key, value in load_file(f).items()}


def test_merged_export_of_a_bin_base_unpickles_each_shard_once(tmp_path, monkeypatch):
    st = save_pretrained_dir(tmp_path / "st")
    base = bin_copy(st, tmp_path / "bin", shards=2)
    args = _args(base, write_prompt_completion(tmp_path / "pc.jsonl"), tmp_path / "run")
    checkpoint = fitted_checkpoint(args, tmp_path / "trained.ckpt")
    loads = count_unpickles(monkeypatch)
    main(["export", f"--ckpt_path={checkpoint}", f"--out={tmp_path / 'from_bin'}", "--merged", *args])
    assert sorted(f for f in loads if str(f).endswith(".bin")) == checkpoint_files(base)  # each twice, before
    from_st = ["export", f"--ckpt_path={checkpoint}", f"--out={tmp_path / 'from_st'}", "--merged"]
    main([*from_st, *args, f"--model.pretrained={st}"])
    from_bin, from_st = _tensors(tmp_path / "from_bin"), _tensors(tmp_path / "from_st")
    assert len(list((tmp_path / "from_bin").glob("*.safetensors"))) == 2 and set(from_bin) == set(from_st)
    for key, tensor in from_st.items():
        assert torch.equal(from_bin[key], tensor), key
