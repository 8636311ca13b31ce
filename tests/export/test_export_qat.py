"""``pl-lowprec export`` of a run trained with ``qat=``: the model converted to torchao's quantized form, which
``fit`` converts when it ends but only in its own process. The export refused such a checkpoint ("The config
trains no LoRA adapters ... Pass the config the checkpoint was trained with"), though it was that config."""

from __future__ import annotations

import pytest
import torch

from pl_lowprec.cli import build_cli, main

pytest.importorskip("torchao")
pytest.importorskip("transformers")


def test_a_qat_run_exports_the_model_its_fit_converted(tmp_path, monkeypatch, capsys):
    from test_configs import ROOT, _fast_args
    from transformers import AutoConfig, AutoModelForCausalLM

    monkeypatch.chdir(tmp_path)
    cli = build_cli(["fit", *_fast_args(ROOT / "configs/qat.yaml"), f"--trainer.default_root_dir={tmp_path}"])
    converted = cli.model.model.eval()  # fit converted it when it ended
    checkpoint = next((tmp_path / "lightning_logs").rglob("*.ckpt"))
    main(["export", f"--ckpt_path={checkpoint}", f"--out={tmp_path / 'out'}", "--trainer.accelerator=cpu"])
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert line.startswith(f"Wrote the QAT model converted to int8-dynamic-int4-weight (14 linear layers as torchao"
                           f" tensors) to {tmp_path / 'out' / 'quantized_model.pt'} from {checkpoint}")  # fmt: skip
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(tmp_path / "out")).eval()
    model.load_state_dict(torch.load(tmp_path / "out" / "quantized_model.pt", weights_only=True), assign=True)
    assert type(model.model.layers[0].mlp.down_proj.weight).__name__ == "IntxUnpackedToInt8Tensor"
    assert type(model.lm_head.weight.data) is torch.Tensor  # the head stays in full precision
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, converted(input_ids=ids).logits)

    with pytest.raises(SystemExit) as refused:
        main(["export", f"--ckpt_path={checkpoint}", f"--out={tmp_path / 'gguf'}", "--format=gguf"])
    assert refused.value.code == 2
    assert "This run trained with qat=, and --format gguf asks for another export" in capsys.readouterr().err
    assert not (tmp_path / "gguf").exists()
