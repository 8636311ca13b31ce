"""``pl-lowprec generate --model`` computes in one dtype for every form of an export (``--dtype``, float32 by
default, as a GGUF file is read): transformers loaded a bf16 merged export in bf16 and a GGUF file in float32,
so comparing the two measured the arithmetic as well as the export."""

from __future__ import annotations

import json

import pytest
import torch
from loading_helpers import save_llama, save_tokenizer

from pl_lowprec.cli import main
from pl_lowprec.export.generate import from_directory

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def bf16_model(tmp_path_factory):
    """A model directory in bf16, as every real checkpoint on the hub is."""
    from transformers import AutoTokenizer

    directory = save_tokenizer(tmp_path_factory.mktemp("bf16"))
    return save_llama(
        directory,
        hidden_size=32,
        layers=1,
        vocab_size=len(AutoTokenizer.from_pretrained(directory)),
        dtype=torch.bfloat16,
    )


def dtypes(generator) -> set[torch.dtype]:
    return {p.dtype for p in generator.model.parameters()}


def test_a_bf16_directory_generates_in_float32_unless_told(bf16_model):
    assert json.loads((bf16_model / "config.json").read_text())["dtype"] == "bfloat16"
    assert dtypes(from_directory(bf16_model, device="cpu")) == {torch.float32}
    assert dtypes(from_directory(bf16_model, device="cpu", dtype="bfloat16")) == {torch.bfloat16}


def test_the_dtype_is_said_and_bad_ones_are_refused(bf16_model, tmp_path, capsys):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("def f(x):\n")
    args = ["generate", f"--prompts={prompts}", "--max_new_tokens=2"]
    main([*args, f"--model={bf16_model}", f"--out={tmp_path / 'a.jsonl'}", "--dtype=bfloat16"])
    assert f"Generating with --model {bf16_model} in bfloat16 (--dtype)." in capsys.readouterr().out
    with pytest.raises(SystemExit) as refused:
        main([*args, f"--model={bf16_model}", f"--out={tmp_path / 'b.jsonl'}", "--dtype=int8"])
    assert refused.value.code == 2
    assert (
        "--dtype 'int8' is not a dtype to generate in: give one of float32, bfloat16, float16"
        in capsys.readouterr().err
    )
    with pytest.raises(SystemExit):
        main([*args, f"--ckpt_path={tmp_path / 'x.ckpt'}", f"--out={tmp_path / 'c.jsonl'}", "--dtype=float32"])
    assert "--dtype float32 applies to --model: a checkpoint runs as it trained" in capsys.readouterr().err
    assert not (tmp_path / "b.jsonl").exists() and not (tmp_path / "c.jsonl").exists()


def test_bfloat16_computes_as_transformers_and_peft_load_it(bf16_model, tmp_path):
    """``--dtype bfloat16`` loads in bf16 as ``from_pretrained(dtype=...)`` and ``PeftModel.from_pretrained`` do:
    a ``.to(dtype)`` after loading also cast the rotary ``inv_freq`` (kept float32 by transformers) and peft's
    adapters (kept float32 on a bf16 base) to bf16, and the logits differed from what users load."""
    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers import AutoModelForCausalLM

    trained = get_peft_model(AutoModelForCausalLM.from_pretrained(bf16_model), LoraConfig(r=4, init_lora_weights=False))
    trained.save_pretrained(tmp_path / "adapter")
    ids = torch.randint(6, 300, (1, 48), generator=torch.Generator().manual_seed(0))

    def logits(model):
        with torch.no_grad():
            return model.eval()(input_ids=ids).logits

    merged = AutoModelForCausalLM.from_pretrained(bf16_model, dtype=torch.bfloat16)
    torch.testing.assert_close(
        logits(from_directory(bf16_model, device="cpu", dtype="bfloat16").model), logits(merged), rtol=0, atol=0
    )
    base = AutoModelForCausalLM.from_pretrained(bf16_model, dtype=torch.bfloat16)
    adapter = PeftModel.from_pretrained(base, tmp_path / "adapter")
    ours = from_directory(tmp_path / "adapter", base=bf16_model, device="cpu", dtype="bfloat16").model
    torch.testing.assert_close(logits(ours), logits(adapter), rtol=0, atol=0)
