"""``pl-lowprec export --format gguf``: the merged model as one GGUF file that transformers reads back to the same
logits, completions and token ids, for Llama, Mistral and Qwen2 shapes, with an Ollama Modelfile beside it.

The models are shrunk from real configs (tests/model_shapes.py: few layers, small heads, the real head counts,
tying, biases and rope scaling) with random weights; the tokenizer is the locally trained demo BPE (no real
model's tokenizer is available offline), so llama.cpp's handling of real vocabularies is not exercised here.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf_helpers import (
    assert_completes_as_merged,
    convert,
    fail_if_called,
    fit_and_export,
    gguf_dir,
    held_out_ids,
    logits,
    metadata,
    refusal_line,
)
from gguf_helpers import shrunk_model as shrunk
from loading_helpers import save_llama, save_tokenizer
from model_shapes import LLAMA31_8B, MISTRAL_7B_V03, QWEN25_05B, SMOLLM2_135M

pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

from pl_lowprec.export.gguf_export import fallback_note  # noqa: E402

# name -> (real config, shrunk head_dim, embedding rows: 320 is the demo tokenizer's size, 352 pads it as Qwen does)
SHAPES = {
    "smollm2": (SMOLLM2_135M, 32, 320),
    "qwen2.5": (QWEN25_05B, 16, 352),
    "llama3.1": (LLAMA31_8B, 8, 320),
    "mistral": (MISTRAL_7B_V03, 8, 320),
}
PROMPTS = [
    "def f(x):\n    return x + 1",
    "  leading spaces\tand tabs\n\n",
    "<|user|>\nimport os</s>",
    "ünïcödé 123 45678 ...!!",
    "class Held(Out):\n    pass",
]


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    return save_tokenizer(tmp_path_factory.mktemp("tokenizer"))


def shrunk_model(directory, tokenizer_dir, name):
    """A bf16 model directory with the real config's quirks, 2 layers and small heads, and the demo tokenizer."""
    return shrunk(directory, tokenizer_dir, *SHAPES[name], bos_token_id=0, eos_token_id=1)


def load_pair(model_dir, gguf_type, name):
    """The merged safetensors model and the GGUF read back, both computing in float32. transformers does not
    read llama3 rope scaling from a GGUF (llama.cpp reads rope_freqs), so that shape gets its config.json."""
    from transformers import AutoConfig, AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    extra = {"config": AutoConfig.from_pretrained(model_dir)} if name == "llama3.1" else {}
    read = AutoModelForCausalLM.from_pretrained(
        gguf_dir(model_dir), gguf_file=f"model-{gguf_type}.gguf", dtype=torch.float32, **extra
    )
    return reference, read


@pytest.mark.parametrize("name", list(SHAPES))
def test_bf16_gguf_reads_back_to_the_same_logits_and_token_ids(tmp_path, tokenizer_dir, name):
    from transformers import AutoTokenizer

    model_dir = shrunk_model(tmp_path / name, tokenizer_dir, name)
    written = convert(model_dir, "bf16")
    reference, read = load_pair(model_dir, "bf16", name)
    ids = held_out_ids()
    torch.testing.assert_close(logits(read, ids), logits(reference, ids), rtol=0, atol=1e-6)  # same bf16 weights

    original = AutoTokenizer.from_pretrained(model_dir)
    from_gguf = AutoTokenizer.from_pretrained(gguf_dir(model_dir), gguf_file="model-bf16.gguf")
    for prompt in PROMPTS:
        assert from_gguf(prompt)["input_ids"] == original(prompt)["input_ids"], prompt
    assert from_gguf.chat_template == original.chat_template
    assert (from_gguf.bos_token, from_gguf.eos_token, from_gguf.pad_token) == ("<s>", "</s>", "<pad>")

    fields, tensors = metadata(gguf_dir(model_dir) / "model-bf16.gguf")
    shape, _, rows = SHAPES[name]
    arch = "qwen2" if name == "qwen2.5" else "llama"
    assert fields["general.architecture"] == arch
    assert fields[f"{arch}.attention.head_count"] == shape["num_attention_heads"]
    assert fields[f"{arch}.attention.head_count_kv"] == shape["num_key_value_heads"]
    assert fields["general.file_type"] == gguf.LlamaFileType.MOSTLY_BF16
    # transformers loads a qwen2 model's tokenizer with Qwen2's split whatever tokenizer.json says: the file names
    # the splitting of the tokenizer as loaded, the one the model learned with
    pre = "qwen2" if name == "qwen2.5" else "gpt-2"
    assert (fields["tokenizer.ggml.model"], fields["tokenizer.ggml.pre"]) == ("gpt2", pre)
    assert len(fields["tokenizer.ggml.tokens"]) == rows and written["vocab"]["tokens"] == rows
    if rows > len(original):  # padded like Qwen's 151,936 rows: unused [PAD] tokens, as llama.cpp writes them
        assert fields["tokenizer.ggml.tokens"][-1] == f"[PAD{rows - 1}]"
        assert fields["tokenizer.ggml.token_type"][-1] == gguf.TokenType.UNUSED
    assert fields["tokenizer.ggml.token_type"][4] == gguf.TokenType.CONTROL  # <|user|>
    assert fields["tokenizer.ggml.bos_token_id"] == 0 and fields["tokenizer.ggml.eos_token_id"] == 1
    assert fields["tokenizer.ggml.padding_token_id"] == 2 and fields["tokenizer.ggml.add_bos_token"] is True
    assert ("output.weight" in tensors) == (not shape["tie_word_embeddings"])
    assert ("blk.0.attn_q.bias" in tensors) == (name == "qwen2.5")
    assert tensors["blk.0.attn_norm.weight"].tensor_type == gguf.GGMLQuantizationType.F32
    assert tensors["blk.0.attn_q.weight"].tensor_type == gguf.GGMLQuantizationType.BF16


def test_llama3_rope_frequencies_are_the_divisors_transformers_applies(tmp_path, tokenizer_dir):
    """llama.cpp reads Llama 3's rope scaling from rope_freqs.weight: it must divide the default frequencies into
    the ones transformers computes for rope_type llama3."""
    from transformers import AutoConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    model_dir = shrunk_model(tmp_path / "llama3.1", tokenizer_dir, "llama3.1")
    convert(model_dir, "bf16")
    _, tensors = metadata(gguf_dir(model_dir) / "model-bf16.gguf")
    config = AutoConfig.from_pretrained(model_dir)
    scaled, _ = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
    default, _ = LlamaRotaryEmbedding.compute_default_rope_parameters(config)
    factors = np.asarray(tensors["rope_freqs.weight"].data)
    assert factors.shape == (4,) and factors.max() == 8.0  # head_dim 8: the lowest frequency divided by 8
    np.testing.assert_allclose(factors, (default / scaled).numpy(), rtol=1e-6)


def test_f16_q8_0_and_q4_0_read_back_within_their_rounding(tmp_path, tokenizer_dir):
    """Each matrix read back is within its type's rounding: f16 half a unit in the last place; Q8_0 0.6 of its
    block's step (absmax/127: half a step, plus the scale stored in f16); Q4_0 one step (absmax/8: the block's
    largest value of the other sign clamps to 7). Norms and biases are F32, exact. The logits stay within the
    stated tolerance: f16 1e-5, q8_0 3% and q4_0 30% of the largest logit."""
    from transformers import AutoModelForCausalLM

    model_dir = shrunk_model(tmp_path / "qwen", tokenizer_dir, "qwen2.5")  # biases, tied, 14/2 heads
    reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    weights = {n: p.detach() for n, p in reference.named_parameters()}
    ids = held_out_ids()
    scale = logits(reference, ids).abs().max()
    q8_0 = (127, 0.6)
    for gguf_type, block_bound, tolerance in (("f16", None, 1e-5), ("q8_0", q8_0, 0.03), ("q4_0", (8, 1.0), 0.30)):
        written = convert(model_dir, gguf_type)
        _, read = load_pair(model_dir, gguf_type, "qwen2.5")
        assert (logits(read, ids) - logits(reference, ids)).abs().max() <= tolerance * scale, gguf_type
        got = dict(read.named_parameters())
        for name, weight in weights.items():
            if weight.dim() < 2:  # norms and biases: F32
                assert torch.equal(got[name], weight), name
                continue
            error = (got[name] - weight).abs()
            if block_bound is None:
                assert error.max() <= weight.abs().max() * 2**-11, name
                continue
            tied_output = name == "model.embed_tokens.weight" and gguf_type == "q4_0"  # Q6_K: rows of 224, so Q8_0
            levels, fraction = q8_0 if tied_output else block_bound
            step = weight.reshape(weight.shape[0], -1, 32).abs().amax(-1, keepdim=True) / levels
            assert (error.reshape(step.shape[0], -1, 32) <= step * fraction + 1e-7).all(), (gguf_type, name)
        expected = {"f16": {"F16": 15}, "q8_0": {"Q8_0": 15}, "q4_0": {"Q4_0": 14, "Q8_0": 1}}[gguf_type]
        assert written["types"] == {"F32": 11, **expected}
        assert fallback_note(written) == ""  # Q4_0's blocks are 32 values: rows of 224 fall back from nothing


# --- the user's path: pl-lowprec fit, then export --format gguf -------------------------------------------------


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory):
    from transformers import AutoTokenizer

    directory = save_tokenizer(tmp_path_factory.mktemp("pretrained"))
    vocab = len(AutoTokenizer.from_pretrained(directory))
    # initializer_range 0.2 instead of 0.02: a random model whose greedy completions differ between prompts
    return save_llama(
        directory, hidden_size=64, layers=2, vocab_size=vocab, dtype=torch.bfloat16, initializer_range=0.2
    )


@pytest.fixture(scope="module")
def trained(pretrained, tmp_path_factory):
    """A QLoRA (nf4) run of a few steps, checkpointed as the strategy writes it, exported --merged and --format
    gguf (bf16) into exports/merged and exports/gguf."""
    root = tmp_path_factory.mktemp("exports")
    rows = [{"prompt": f"def f{i}(x):\n    return", "completion": f" x + {i}"} for i in range(40)]
    checkpoint, args, _ = fit_and_export(pretrained, root, rows)
    return checkpoint, args, root


@pytest.fixture(scope="module")
def exported(trained):
    return trained[2]


def test_exported_gguf_completes_as_the_merged_model(exported):
    words = ["import", "return", "class", "self", "while", "lambda", "yield", "assert", "raise", "with"]
    prompts = [f"{words[i % 10]} {words[(3 * i + 1) % 10]}_{i}(" for i in range(20)]
    assert_completes_as_merged(exported, prompts, held_out_ids())


DEMO_MODELFILE = (
    "FROM ./model-bf16.gguf\n"
    'TEMPLATE """{{ range $i, $_ := .Messages }}{{ $last := eq (len (slice $.Messages $i)) 1 }}'
    '{{ if eq .Role "system" }}<|system|>\n{{ .Content }}</s>\n'
    '{{ else if eq .Role "user" }}<|user|>\n{{ .Content }}</s>\n'
    '{{ else if eq .Role "assistant" }}<|assistant|>\n{{ .Content }}</s>\n'
    '{{ end }}{{ if and $last (ne .Role "assistant") }}<|assistant|>\n{{ end }}{{ end }}"""\n'
    'PARAMETER stop "</s>"\n'
    'PARAMETER stop "<|user|>"\n'
)


def test_modelfile_has_the_template_and_stop_tokens(exported):
    assert (exported / "gguf" / "Modelfile").read_text() == DEMO_MODELFILE


def test_q4_k_m_export_from_the_users_checkpoint(trained, tmp_path, capsys):
    """``pl-lowprec export --format gguf --gguf_type q4_k_m`` from the fit's checkpoint: hidden 64 splits into no
    256-value super-block, so every matrix takes llama-quantize's fallback (Q5_0; Q8_0 for the output matrix and
    where Q4_K_M gives more bits), the summary and header say so, and the Modelfile names the file."""
    from pl_lowprec.cli import main

    checkpoint, args, _ = trained
    out = tmp_path / "gguf"
    main(["export", f"--ckpt_path={checkpoint}", f"--out={out}", "--format=gguf", "--gguf_type=q4_k_m", *args])
    printed = " ".join(capsys.readouterr().out.split())
    assert f"Wrote {out / 'model-q4_k_m.gguf'} (llama," in printed
    assert "21 tensors: 5 F32, 13 Q5_0, 3 Q8_0;" in printed, printed
    assert (
        "Matrices whose rows do not split into 256-value k-quant super-blocks (14 with rows of 64, 2 with rows of 192)"
        " are written in llama-quantize's fallback types (Q4_K -> Q5_0, Q6_K -> Q8_0), as it writes them."
    ) in printed, printed
    assert sorted(p.name for p in out.iterdir()) == ["Modelfile", "model-q4_k_m.gguf"]
    assert (out / "Modelfile").read_text().startswith("FROM ./model-q4_k_m.gguf\n")
    fields, tensors = metadata(out / "model-q4_k_m.gguf")
    assert fields["general.file_type"] == int(gguf.LlamaFileType.MOSTLY_Q4_K_M)
    assert (
        tensors["output.weight"].tensor_type.name == "Q8_0" and tensors["token_embd.weight"].tensor_type.name == "Q5_0"
    )
    assert tensors["blk.1.ffn_down.weight"].tensor_type.name == "Q8_0"  # use_more_bits(1, 2)
    assert tensors["blk.0.ffn_down.weight"].tensor_type.name == "Q5_0"


def test_several_types_from_one_merge_and_q3_k_m_names_each_fallback_it_took(trained, tmp_path, capsys):
    """``--gguf_type q3_k_m,q8_0,q3_k_m``: a file for each type (once each), the Modelfile for the first. Q3_K_M
    mixes four k-quant types (Q3_K; Q4_K for attn_output and ffn_down; Q5_K for the first two attn_v; Q6_K for
    the output), and on rows of 64 each becomes its own fallback, named in the summary."""
    from pl_lowprec.cli import main

    checkpoint, args, _ = trained
    out = tmp_path / "gguf"
    types = "--gguf_type=q3_k_m,q8_0,q3_k_m"
    main(["export", f"--ckpt_path={checkpoint}", f"--out={out}", "--format=gguf", types, *args])
    lines = capsys.readouterr().out.strip().splitlines()
    assert sorted(p.name for p in out.iterdir()) == ["Modelfile", "model-q3_k_m.gguf", "model-q8_0.gguf"]
    assert (out / "Modelfile").read_text().startswith("FROM ./model-q3_k_m.gguf\n")
    assert lines[-1].startswith(f"Also wrote {out / 'model-q8_0.gguf'} (") and "16 Q8_0;" in lines[-1], lines
    assert lines[-1].endswith(f"ollama create NAME -f {out / 'Modelfile'} with its FROM line set to ./model-q8_0.gguf.")
    _, q8_tensors = metadata(out / "model-q8_0.gguf")
    assert {t.tensor_type.name for t in q8_tensors.values()} == {"F32", "Q8_0"}
    printed = " ".join(lines[-2].split())
    assert "21 tensors: 5 F32, 9 Q4_0, 4 Q5_0, 2 Q5_1, 1 Q8_0;" in printed, printed
    assert (
        "fallback types (Q2_K or Q3_K -> Q4_0, Q4_K -> Q5_0, Q5_K -> Q5_1, Q6_K -> Q8_0), as it writes them." in printed
    )
    fields, tensors = metadata(out / "model-q3_k_m.gguf")
    assert fields["general.file_type"] == int(gguf.LlamaFileType.MOSTLY_Q3_K_M)
    assert tensors["blk.1.attn_v.weight"].tensor_type.name == "Q5_1"  # Q5_K in the first two layers
    assert tensors["blk.1.attn_output.weight"].tensor_type.name == "Q5_0"  # Q4_K
    assert tensors["blk.1.attn_q.weight"].tensor_type.name == "Q4_0"  # Q3_K


def test_generate_reads_a_gguf_export_as_it_reads_the_merged_one(exported, tmp_path, capsys, monkeypatch):
    """``pl-lowprec generate --model model-bf16.gguf``: transformers reads the file (the tokenizer from its
    metadata); its bf16 weights are the merged export's, so every completion is the same, and so is the count of
    completions equal to their reference on the summary line. A missing file, or no gguf package, is refused."""
    import pl_lowprec.export.gguf_read as gguf_read
    from pl_lowprec.cli import main

    prompts = tmp_path / "held_out.jsonl"
    rows = [{"prompt": f"def g{i}(x):\n    return", "completion": f" x + {i}"} for i in range(8)]
    prompts.write_text("".join(json.dumps(row) + "\n" for row in rows))
    lines, completions = {}, {}
    for name, model in (("merged", exported / "merged"), ("gguf", exported / "gguf" / "model-bf16.gguf")):
        out = tmp_path / f"{name}.jsonl"
        main(["generate", f"--model={model}", f"--prompts={prompts}", f"--out={out}", "--max_new_tokens=6"])
        lines[name] = capsys.readouterr().out.strip().splitlines()[-1].replace(str(out), "OUT")
        completions[name] = [json.loads(line)["completion"] for line in out.read_text().splitlines()]
    assert completions["gguf"] == completions["merged"] and len(set(completions["merged"])) > 1
    assert lines["gguf"] == lines["merged"], lines
    equal = sum(got == row["completion"] for got, row in zip(completions["gguf"], rows, strict=True))
    assert lines["gguf"] == f"Wrote 8 completions to OUT ({equal} of 8 equal to their reference)."
    base = ["generate", f"--prompts={prompts}", f"--out={tmp_path / 'x.jsonl'}"]
    line = refusal_line(capsys, [*base, f"--model={tmp_path / 'model-q4_k_m.gguf'}"])
    assert "model-q4_k_m.gguf' does not exist: name a .gguf file that `pl-lowprec export --format gguf` wrote" in line
    monkeypatch.setattr(gguf_read, "gguf_missing", lambda: "gguf>=0.19 is not installed. Install it with: X")
    line = refusal_line(capsys, [*base, f"--model={exported / 'gguf' / 'model-bf16.gguf'}"])
    assert "is a GGUF file, which transformers reads with gguf>=0.19 is not installed. Install it with: X" in line


def test_a_gguf_file_cut_short_or_not_gguf_is_named_before_anything_loads(exported, tmp_path, capsys):
    """A copy cut inside its header gave a Python traceback (struct.error), one cut inside its tensors numpy's
    "cannot reshape array"; a text file named .gguf was suggested beside a --model that is not a model."""

    whole = (exported / "gguf" / "model-bf16.gguf").read_bytes()
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("def f(x):\n")
    base = ["generate", f"--prompts={prompts}", f"--out={tmp_path / 'x.jsonl'}"]
    for name, size in (("header", 5000), ("tensors", len(whole) * 3 // 4)):
        cut = tmp_path / f"cut_in_{name}.gguf"
        cut.write_bytes(whole[:size])
        line = refusal_line(capsys, [*base, f"--model={cut}"])
        assert "is a GGUF file that does not read (" in line and f"most likely it was cut short ({size} bytes)" in line
    (tmp_path / "notes.gguf").write_text("not a model")
    line = refusal_line(capsys, [*base, f"--model={tmp_path / 'notes.gguf'}"])
    assert "notes.gguf' is not a GGUF file: it does not begin with the bytes 'GGUF' (11 bytes)" in line
    (tmp_path / "notes.txt").write_text("not a model")
    line = refusal_line(capsys, [*base, f"--model={tmp_path / 'notes.txt'}"])
    named = f"--model {str(tmp_path / 'cut_in_header.gguf')!r} or --model {str(tmp_path / 'cut_in_tensors.gguf')!r}."
    assert line.endswith(f"Its directory holds GGUF files: pass the .gguf file itself, {named}")  # not notes.gguf
    assert not (tmp_path / "x.jsonl").exists()


def test_a_model_directory_converts_to_the_file_its_checkpoint_exports(exported, tmp_path, capsys, monkeypatch):
    """``export --model runs/merged --format gguf``: the merged export converted as it is (no checkpoint) holds the
    tensors the checkpoint's own GGUF export holds, byte for byte, and its Modelfile; a hub id is downloaded
    (here: a stand-in download), or refused with the fix offline; a directory it cannot convert is refused with
    the fix, before anything is written."""
    from pl_lowprec.cli import main

    out = tmp_path / "from_model"
    main(["export", f"--model={exported / 'merged'}", f"--out={out}", "--format=gguf"])
    assert f"Wrote {out / 'model-bf16.gguf'} (llama," in capsys.readouterr().out
    fields, converted = metadata(out / "model-bf16.gguf")
    checkpoint_fields, from_checkpoint = metadata(exported / "gguf" / "model-bf16.gguf")
    assert (fields["general.name"], checkpoint_fields["general.name"]) == ("merged", "gguf")  # as llama.cpp names
    assert list(converted) == list(from_checkpoint)
    for name, tensor in from_checkpoint.items():
        assert np.array_equal(np.asarray(converted[name].data), np.asarray(tensor.data)), name
    assert (out / "Modelfile").read_text() == DEMO_MODELFILE
    import huggingface_hub

    monkeypatch.setattr(huggingface_hub, "snapshot_download", lambda repo_id, **kwargs: str(exported / "merged"))
    main(["export", "--model=org/finetune", f"--out={tmp_path / 'from_hub'}", "--format=gguf", "--gguf_type=q8_0"])
    assert "from org/finetune." in capsys.readouterr().out
    assert metadata(tmp_path / "from_hub" / "model-q8_0.gguf")[0]["general.name"] == "finetune"

    def offline(*args, **kwargs):
        raise ConnectionError("no network")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", offline)
    line = refusal_line(capsys, ["export", "--model=org/finetune", f"--out={tmp_path / 'x'}", "--format=gguf"])
    assert "--model 'org/finetune' is not a local directory, and downloading it from the Hugging Face Hub" in line
    assert "(`hf download org/finetune --local-dir DIR`) and pass --model DIR." in line
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text("{}")
    quantized = tmp_path / "quantized"
    shutil.copytree(exported / "merged", quantized)
    config = json.loads((quantized / "config.json").read_text())
    (quantized / "config.json").write_text(json.dumps({**config, "quantization_config": {"load_in_4bit": True}}))
    base = ["export", f"--out={tmp_path / 'refused'}"]
    cases = [
        ([f"--model={adapter}", "--format=gguf"], "is a peft adapter: --model converts a model directory"),
        ([f"--model={quantized}", "--format=gguf"], "holds quantized weights (config.json has a quantization_config)"),
        ([f"--model={exported / 'merged'}", "--merged"], "--model converts a model directory to GGUF (--format gguf)"),
    ]
    for extra, message in cases:
        assert message in refusal_line(capsys, [*base, *extra])
    assert not (tmp_path / "refused").exists()


def test_refusals_come_before_anything_loads_and_name_the_fix(trained, pretrained, tmp_path, monkeypatch, capsys):
    import pl_lowprec.export.gguf_export as gguf_export

    fail_if_called(monkeypatch, ["pl_lowprec.cli.export.restore"], "the checkpoint was restored")
    checkpoint, args, _ = trained
    out = tmp_path / "gguf"
    base = ["export", f"--ckpt_path={checkpoint}", f"--out={out}", *args]
    cases = [
        (
            ["--format=gguf", "--gguf_type=q5_k"],
            r"--gguf_type 'q5_k' is not one this export writes\. It writes auto \(the default",
        ),
        (["--format=gguf", "--gguf_type=q4_k_m,q5_k"], r"--gguf_type 'q5_k' is not one this export writes"),
        (
            ["--format=gguf", "--gguf_type=q8_0,,f16"],
            r"--gguf_type 'q8_0,,f16' has an empty item between its commas\. .*: --gguf_type q8_0,f16\.$",
        ),
        (
            ["--format=gguf", "--gguf_type=IQ4_XS"],
            r"IQ4_XS is one of llama.cpp's importance-matrix types .* run"
            r" llama-quantize --imatrix on the file; or choose q2_k or q3_k_s, which need none\.",
        ),
        (["--format=gguf", "--gguf_type=Q4_K_M"], r"--gguf_type is written in lower case.*: --gguf_type q4_k_m\.$"),
        (["--format=gguf", "--dtype=float32"], r"--dtype float32 sets the dtype of a --format merged export"),
        (["--format=gguf", "--merged"], r"--merged asks for a merged model directory and --format gguf"),
        (["--gguf_type=q8_0"], r"--gguf_type q8_0 applies to --format gguf, and this export is --format adapter"),
        (["--format=onnx"], r"--format 'onnx' is not one of adapter, merged, gguf"),
    ]
    for extra, message in cases:
        assert re.search(message, refusal_line(capsys, [*base, *extra]))
    metaspace = tmp_path / "metaspace_tokenizer"  # a tokenizer that splits as SentencePiece does
    shutil.copytree(pretrained, metaspace, ignore=shutil.ignore_patterns("*.safetensors", "config.json"))
    tokenizer_json = json.loads((metaspace / "tokenizer.json").read_text())
    tokenizer_json["pre_tokenizer"] = {"type": "Metaspace", "replacement": "\u2581", "prepend_scheme": "always"}
    (metaspace / "tokenizer.json").write_text(json.dumps(tokenizer_json))
    line = refusal_line(capsys, [*base, "--format=gguf", f"--data.tokenizer={metaspace}"])
    assert "metaspace_tokenizer' splits text with a pre-tokenizer llama.cpp has no" in line
    monkeypatch.setattr(gguf_export, "gguf_missing", lambda: "gguf>=0.19 is not installed. Install it with: X")
    line = refusal_line(capsys, [*base, "--format=gguf"])
    assert "llama.cpp's gguf package: gguf>=0.19 is not installed. Install it with" in line
    assert not out.exists()


def test_without_the_gguf_package_the_refusal_names_the_extra():
    """The package imports without gguf; asking for --format gguf names the extra to install."""
    import sys

    script = (
        "import sys, importlib.abc\n"
        "class Block(importlib.abc.MetaPathFinder):\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] == 'gguf':\n"
        "            raise ModuleNotFoundError(name)\n"
        "sys.meta_path.insert(0, Block())\n"
        "from lightning_utilities.core import imports\n"
        "available = imports.RequirementCache.__bool__\n"
        "imports.RequirementCache.__bool__ = lambda self: available(self) and not self.requirement.startswith('gguf')\n"
        "from pl_lowprec.export.gguf_export import check_gguf_request\n"
        "try:\n"
        "    check_gguf_request('q8_0', None)\n"
        "except ValueError as err:\n"
        "    print(err)\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, check=True)
    assert "--format gguf writes the file with llama.cpp's gguf package" in done.stdout
    assert 'Install it with: pip install "pl_lowprec[gguf]"' in done.stdout


def test_unsupported_models_and_tokenizers_are_refused_before_the_weights_load(tmp_path, tokenizer_dir):
    from transformers import GPT2Config

    from pl_lowprec.export.gguf_arch import architecture
    from pl_lowprec.export.gguf_vocab import check_tokenizer, check_tokenizer_json
    from pl_lowprec.loading.tokenizer import load_tokenizer

    with pytest.raises(ValueError, match=r"model_type='gpt2'. Export --format merged and convert it with llama"):
        architecture(GPT2Config())
    assert check_tokenizer(load_tokenizer(tokenizer_dir), tokenizer_dir, 320) == "gpt2"
    with pytest.raises(ValueError, match=r"has token id 319, and the model's embedding has vocab_size=300 rows"):
        check_tokenizer(load_tokenizer(tokenizer_dir), tokenizer_dir, 300)
    tokenizer_json = json.loads((tokenizer_dir / "tokenizer.json").read_text())
    byte_fallback = r"SentencePiece-style BPE \(byte fallback\).* but it splits text otherwise than SentencePiece"
    for index, (change, message) in enumerate(
        (
            ({"pre_tokenizer": {"type": "Metaspace", "replacement": "\u2581"}}, r"pre-tokenizer llama.cpp has no name"),
            ({"model": {**tokenizer_json["model"], "byte_fallback": True}}, byte_fallback),
        )
    ):
        with pytest.raises(ValueError, match=message):
            check_tokenizer_json({**tokenizer_json, **change}, f"tokenizer{index}", 320)


def test_pre_tokenizer_names_are_the_splits_transformers_rebuilds():
    """Llama 3's and Qwen2's regexes get the names under which transformers' GGUF reader splits with the same."""
    from transformers.integrations.gguf.gguf_tokenizer_mapping import GGUF_PRE_TOKENIZER_SPLITS

    from pl_lowprec.export.gguf_vocab import LLAMA3_SPLIT, QWEN2_SPLIT, pre_tokenizer

    for pattern, name in ((LLAMA3_SPLIT, "llama-bpe"), (QWEN2_SPLIT, "qwen2")):
        split = {"type": "Split", "pattern": {"Regex": pattern}, "behavior": "Isolated", "invert": False}
        byte_level = {"type": "ByteLevel", "add_prefix_space": False, "use_regex": False}
        assert pre_tokenizer({"pre_tokenizer": {"type": "Sequence", "pretokenizers": [split, byte_level]}}) == name
        assert GGUF_PRE_TOKENIZER_SPLITS[name] == pattern
    smollm = [{"type": "Digits", "individual_digits": True}, {"type": "ByteLevel", "add_prefix_space": False}]
    assert pre_tokenizer({"pre_tokenizer": {"type": "Sequence", "pretokenizers": smollm}}) == "smollm"
    assert pre_tokenizer({"pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": True}}) is None


# --- the Modelfile's TEMPLATE: chat templates of the usual shapes (written for these tests) -------------------------

CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
# ChatML with a default system turn when the conversation has none, as Qwen2.5's template adds one
CHATML_DEFAULT_SYSTEM = (
    "{% if messages[0]['role'] != 'system' %}{{ '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}"
    "{% endif %}" + CHATML
)
# Llama 3's shape: the template writes BOS, headers around the role, contents trimmed
LLAMA3 = (
    "{{ bos_token }}{% for message in messages %}{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'"
    " + message['content'] | trim + '<|eot_id|>' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"
)
RENDER_GO = Path(__file__).parents[1] / "_scripts" / "render_go_template.go"


def render_with_go(template, messages):
    """The prompt Ollama renders: Go's text/template over .Messages (needs the go toolchain)."""
    request = {"Template": template, "Messages": [{"Role": m["role"], "Content": m["content"]} for m in messages]}
    done = subprocess.run(
        ["go", "run", str(RENDER_GO)], input=json.dumps(request), capture_output=True, text=True, check=True
    )
    return done.stdout


@pytest.mark.parametrize("name", ["demo", "chatml", "chatml_default_system", "llama3"])
def test_chat_templates_become_go_templates_that_render_the_same_prompts(tokenizer_dir, name):
    from pl_lowprec.export.modelfile import chat_parts, probe_conversations, render_go, verified_template
    from pl_lowprec.loading.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(tokenizer_dir)
    templates = {"chatml": CHATML, "chatml_default_system": CHATML_DEFAULT_SYSTEM, "llama3": LLAMA3}
    tokenizer.chat_template = templates.get(name, tokenizer.chat_template)
    parts = chat_parts(tokenizer, add_bos=True)
    template = verified_template(tokenizer, parts)
    assert template is not None
    if name == "llama3":  # llama.cpp adds BOS itself (add_bos_token): the template's own is left out
        assert parts.dropped == "<s>" and parts.suffix["assistant"] == "<|eot_id|>"
        assert parts.stops("</s>") == ["</s>", "<|eot_id|>", "<|start_header_id|>user<|end_header_id|>"]
    if name == "chatml_default_system":
        assert parts.default_system == "You are a helpful assistant." and parts.start == ""
    for messages in probe_conversations():
        jinja = tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=messages[-1]["role"] != "assistant"
        ).removeprefix(parts.dropped)
        assert render_go(parts, messages) == jinja
        if shutil.which("go"):
            assert render_with_go(template, messages) == jinja


def test_templates_that_are_not_fixed_strings_per_turn_get_no_template(tokenizer_dir):
    """A template that numbers turns, or refuses a system turn, cannot be written as fixed strings: no TEMPLATE
    (Ollama then picks one from the GGUF's chat template), and the Modelfile still has FROM and the stops."""
    from pl_lowprec.export.modelfile import chat_parts, modelfile, verified_template
    from pl_lowprec.loading.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(tokenizer_dir)
    tokenizer.chat_template = (
        "{% for m in messages %}[{{ loop.index }}] {{ m['role'] }}: {{ m['content'] }}\\n{% endfor %}"
    )
    assert chat_parts(tokenizer, add_bos=True) is not None
    assert verified_template(tokenizer, chat_parts(tokenizer, add_bos=True)) is None
    tokenizer.chat_template = (
        "{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception('no system') }}{% endif %}"
        "{{ '[INST] ' + m['content'] + ' [/INST]' if m['role'] == 'user' else m['content'] + eos_token }}{% endfor %}"
    )
    assert chat_parts(tokenizer, add_bos=True) is None
    assert modelfile("model-q8_0.gguf", None, ["</s>"]) == 'FROM ./model-q8_0.gguf\nPARAMETER stop "</s>"\n'


def test_a_truncated_weight_file_is_named_with_its_size_before_anything_is_written(tmp_path, tokenizer_dir):
    model_dir = shrunk_model(tmp_path / "model", tokenizer_dir, "smollm2")
    weights = model_dir / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])  # a copy cut short
    with pytest.raises(ValueError, match=r"model\.safetensors \(100 bytes\) is not a complete safetensors file"):
        convert(model_dir, "bf16")
    assert not list(gguf_dir(model_dir).glob("*.gguf"))


def test_generate_reads_a_llama3_gguf_with_its_rope_frequencies(tmp_path, tokenizer_dir):
    """transformers' GGUF reader ignores rope_freqs.weight (Llama 3's rope scaling, which llama.cpp applies), so
    ``generate --model X.gguf`` computed with the default frequencies; ``gguf_model`` applies them."""
    from transformers import AutoModelForCausalLM

    from pl_lowprec.export.gguf_read import gguf_model

    model_dir = shrunk_model(tmp_path / "llama3.1", tokenizer_dir, "llama3.1")
    convert(model_dir, "bf16")
    reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    read = gguf_model(gguf_dir(model_dir) / "model-bf16.gguf")
    ids = torch.randint(6, 320, (1, 512), generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(logits(read, ids), logits(reference, ids), rtol=0, atol=1e-5)  # same bf16 weights
