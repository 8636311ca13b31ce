"""``--format gguf`` with a SentencePiece-style tokenizer (BPE with byte fallback, as Llama 2's and Mistral 7B's):
``tokenizer.ggml.model = llama`` with tokens, scores and types, read back by transformers to the same ids, logits
and completions, and tokenized by llama.cpp's own algorithm (tests/llama_cpp_tokenizer.py, a port) to the same ids.

The tokenizer is built offline in Mistral-7B-v0.3's shape (tests/sentencepiece_tokenizer.py) and attached to
Mistral-7B-v0.3's config shrunk; no real vocabulary is available offline.
"""

from __future__ import annotations

import json
import re
import shutil

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
    shrunk_model,
)
from llama_cpp_tokenizer import LlamaCppSpm
from model_shapes import MISTRAL_7B_V03
from sentencepiece_tokenizer import CONTROL, USER_DEFINED, WHITESPACE, save_sentencepiece_tokenizer

pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

PROMPTS = [
    "def f(x):\n    return x + 1",  # runs of spaces: tokens early by id, merged last
    "ünïcödé 123 45678 ...!!",  # characters the vocabulary lacks: byte fallback
    "日本語のテキスト 🤖 emoji",
    "[INST]What is 2+2?[/INST]",  # control tokens inside the text
    "[INST]a <unk> b</s>",  # the unknown token (UNKNOWN, not CONTROL) is still matched whole
    "<think>hmm</think> ok",  # a user-defined added token
    "class Held(Out):\n        pass\t# eight spaces\n\n",
]


def held_out_text(chunks: int = 120, size: int = 160) -> list[str]:
    """Standard library source past what the tokenizer learned on, in chunks (leading spaces dropped: see
    test_llama_cpp_and_transformers_differ_where_llama_cpp_adds_its_space)."""
    from pl_lowprec.demo.stdlib_text import stdlib_bytes

    text = stdlib_bytes(400_000)[250_000:].decode("utf-8", "replace")
    return [text[i : i + size].lstrip(" ") for i in range(0, chunks * size, size)]


@pytest.fixture(scope="module")
def spm_dir(tmp_path_factory):
    return save_sentencepiece_tokenizer(tmp_path_factory.mktemp("sentencepiece"))


@pytest.fixture(scope="module")
def mistral(spm_dir, tmp_path_factory):
    """Mistral-7B-v0.3 shrunk (32/8 heads of 8), its embedding padded to a multiple of 32 rows, converted to bf16."""
    from transformers import AutoTokenizer

    rows = -(-len(AutoTokenizer.from_pretrained(spm_dir)) // 32) * 32
    model_dir = shrunk_model(tmp_path_factory.mktemp("mistral") / "model", spm_dir, MISTRAL_7B_V03, 8, rows)
    written = convert(model_dir, "bf16")
    fields, _ = metadata(gguf_dir(model_dir) / "model-bf16.gguf")
    return model_dir, written, fields


def test_the_tokenizer_is_shaped_like_mistral_v03s(spm_dir):
    """The fixture is what the test claims: transformers loads a LlamaTokenizer that splits as SentencePiece
    (Metaspace, text whole), adds BOS, falls back on bytes, and merges runs of spaces last."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(spm_dir)
    backend = json.loads(tokenizer.backend_tokenizer.to_str())
    assert type(tokenizer).__name__ == "LlamaTokenizer" and backend["model"]["byte_fallback"]
    metaspace = {"type": "Metaspace", "replacement": "▁", "prepend_scheme": "first", "split": False}
    assert backend["pre_tokenizer"] == metaspace
    assert tokenizer.tokenize("return ü", add_special_tokens=True) == ["<s>", "▁return", "▁", "<0xC3>", "<0xBC>"]
    assert "▁▁▁" in tokenizer.tokenize("    return") and tokenizer.convert_tokens_to_ids(WHITESPACE[0]) < 300


def test_transformers_reads_the_file_back_to_the_same_logits_token_ids_and_template(mistral):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_dir, written, _ = mistral
    reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    read = AutoModelForCausalLM.from_pretrained(gguf_dir(model_dir), gguf_file="model-bf16.gguf", dtype=torch.float32)
    ids = held_out_ids(written["config"].vocab_size)
    torch.testing.assert_close(logits(read, ids), logits(reference, ids), rtol=0, atol=1e-6)  # same bf16 weights
    original = AutoTokenizer.from_pretrained(model_dir)
    from_gguf = AutoTokenizer.from_pretrained(gguf_dir(model_dir), gguf_file="model-bf16.gguf")
    for prompt in [*PROMPTS, *held_out_text()]:
        assert from_gguf(prompt)["input_ids"] == original(prompt)["input_ids"], prompt
        assert from_gguf.decode(from_gguf(prompt)["input_ids"], skip_special_tokens=True) == original.decode(
            original(prompt)["input_ids"], skip_special_tokens=True
        )
    assert from_gguf.chat_template == original.chat_template
    assert (from_gguf.bos_token, from_gguf.eos_token, from_gguf.unk_token) == ("<s>", "</s>", "<unk>")


def test_the_file_has_tokens_scores_and_types_as_llama_cpps_converter_writes_them(mistral, spm_dir):
    from transformers import AutoTokenizer

    _, written, fields = mistral
    tokenizer = AutoTokenizer.from_pretrained(spm_dir)
    tokens, scores, types = (fields[f"tokenizer.ggml.{k}"] for k in ("tokens", "scores", "token_type"))
    rows = written["config"].vocab_size
    assert (fields["tokenizer.ggml.model"], fields["tokenizer.ggml.pre"]) == ("llama", "default")
    assert len(tokens) == len(scores) == len(types) == rows == written["vocab"]["tokens"] > len(tokenizer)
    assert len(set(tokens)) == rows and "tokenizer.ggml.merges" not in fields
    kind = gguf.TokenType
    assert types[0] == kind.UNKNOWN and {types[i] for i in range(1, len(CONTROL))} == {kind.CONTROL}
    assert tokens[: len(CONTROL)] == CONTROL and tokens[len(CONTROL) + 10] == "<0x0A>"
    byte_rows = slice(len(CONTROL), len(CONTROL) + 256)
    assert set(types[byte_rows]) == {kind.BYTE} and set(scores[byte_rows]) == {0.0}
    assert types[tokenizer.convert_tokens_to_ids(USER_DEFINED)] == kind.USER_DEFINED
    assert tokens[-1] == f"[PAD{rows - 1}]" and types[-1] == kind.UNUSED
    # a merged token's score is minus the rank of the first merge making it: llama.cpp merges in that order
    merges = json.loads(tokenizer.backend_tokenizer.to_str())["model"]["merges"]
    first = {}
    for rank, (left, right) in enumerate(merges):
        first.setdefault(left + right, rank)
    assert all(scores[tokens.index(token)] == -rank for token, rank in first.items())
    assert scores[tokens.index("▁▁")] < scores[tokens.index("▁return")]  # not by id: "▁▁" is early by id
    assert fields["tokenizer.ggml.add_space_prefix"] is True
    assert fields["tokenizer.ggml.add_bos_token"] is True and fields["tokenizer.ggml.add_eos_token"] is False
    assert [fields[f"tokenizer.ggml.{k}_token_id"] for k in ("bos", "eos", "unknown")] == [1, 2, 0]
    assert written["vocab"]["add_space_prefix"] is True and written["vocab"]["merges"] == len(merges)


def test_llama_cpp_tokenizes_and_decodes_the_file_as_transformers(mistral, spm_dir):
    """llama.cpp's SentencePiece tokenizer on the file's tokens, scores and types gives the ids transformers gives
    (BOS included), and prints the text back (byte tokens decode to bytes)."""
    from transformers import AutoTokenizer

    _, _, fields = mistral
    llama_cpp = LlamaCppSpm.from_fields(fields)
    tokenizer = AutoTokenizer.from_pretrained(spm_dir)
    texts = [p for p in PROMPTS if not p.startswith("[INST]") and not p.startswith("<think>")] + held_out_text()
    for text in texts:
        ids = llama_cpp.tokenize(text)
        assert ids == tokenizer(text)["input_ids"], text
        assert llama_cpp.detokenize(ids[1:]) == text
    # control tokens in the text: parsed only when asked (as llama.cpp does for a chat-templated prompt)
    prompt = "[INST]What is 2+2?[/INST]"
    assert llama_cpp.tokenize(prompt, parse_special=True)[1] == tokenizer.convert_tokens_to_ids("[INST]")
    assert tokenizer.convert_tokens_to_ids("[INST]") not in llama_cpp.tokenize(prompt)


def test_llama_cpp_and_transformers_differ_where_llama_cpp_adds_its_space(mistral, spm_dir):
    """What the docs state: llama.cpp puts a space before every text fragment that starts the prompt or follows a
    special or user-defined token, even one that starts with a space; transformers' Llama tokenizer only before
    the start of the text, and not when it starts with a space."""
    from transformers import AutoTokenizer

    _, _, fields = mistral
    llama_cpp = LlamaCppSpm.from_fields(fields)
    tokenizer = AutoTokenizer.from_pretrained(spm_dir)
    assert llama_cpp.tokenize(" leading space") == tokenizer("  leading space")["input_ids"]
    assert llama_cpp.tokenize(" leading space") != tokenizer(" leading space")["input_ids"]
    chat = llama_cpp.tokenize("[INST]What is 2+2?[/INST]", parse_special=True)
    assert chat == tokenizer("[INST] What is 2+2?[/INST]")["input_ids"]
    assert chat != tokenizer("[INST]What is 2+2?[/INST]")["input_ids"]


def test_a_tokenizer_that_adds_no_bos_says_so_in_the_file(mistral, tmp_path):
    """llama.cpp adds BOS to a SentencePiece vocabulary unless the file says not to; a tokenizer whose files do not
    say (no add_bos_token, no post-processor: transformers then adds none) gets add_bos_token false written."""
    from transformers import AutoTokenizer

    source, _, _ = mistral
    model_dir = tmp_path / "model"
    shutil.copytree(source, model_dir)
    config = json.loads((model_dir / "tokenizer_config.json").read_text())
    config.pop("add_bos_token", None)
    config.pop("add_eos_token", None)
    (model_dir / "tokenizer_config.json").write_text(json.dumps(config))
    tokenizer_json = json.loads((model_dir / "tokenizer.json").read_text())
    (model_dir / "tokenizer.json").write_text(json.dumps({**tokenizer_json, "post_processor": None}))
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    assert tokenizer("def f")["input_ids"][0] != tokenizer.bos_token_id
    convert(model_dir, "bf16")
    fields, _ = metadata(gguf_dir(model_dir) / "model-bf16.gguf")
    assert fields["tokenizer.ggml.add_bos_token"] is False
    assert LlamaCppSpm.from_fields(fields).tokenize("def f") == tokenizer("def f")["input_ids"]


# --- the user's path: pl-lowprec fit on a Mistral with this tokenizer, then export --format gguf ------------------

MISTRAL_MODELFILE = (
    "FROM ./model-bf16.gguf\n"
    'TEMPLATE """{{ range $i, $_ := .Messages }}{{ $last := eq (len (slice $.Messages $i)) 1 }}'
    '{{ if eq .Role "system" }}[SYSTEM_PROMPT]{{ .Content }}[/SYSTEM_PROMPT]'
    '{{ else if eq .Role "user" }}[INST]{{ .Content }}[/INST]'
    '{{ else if eq .Role "assistant" }}{{ .Content }}</s>'
    '{{ end }}{{ if and $last (ne .Role "assistant") }}{{ end }}{{ end }}"""\n'
    'PARAMETER stop "</s>"\n'
    'PARAMETER stop "[INST]"\n'
)


@pytest.fixture(scope="module")
def exported(spm_dir, tmp_path_factory):
    """A QLoRA (nf4) chat fine-tune of a few steps of the shrunk Mistral, exported --merged and --format gguf."""
    from transformers import AutoTokenizer

    pretrained = tmp_path_factory.mktemp("pretrained") / "model"
    rows = len(AutoTokenizer.from_pretrained(spm_dir))
    # initializer_range 0.2 instead of 0.02: a random model whose greedy completions differ between prompts
    shrunk_model(pretrained, spm_dir, MISTRAL_7B_V03, 8, rows, initializer_range=0.2)
    root = tmp_path_factory.mktemp("exports")
    chats = [
        {"messages": [{"role": "user", "content": f"What is {i} + 1?"}, {"role": "assistant", "content": f"{i + 1}"}]}
        for i in range(40)
    ]
    checkpoint, args, printed = fit_and_export(pretrained, root, chats)
    return root, printed, checkpoint, args


def test_fine_tuned_mistral_gguf_completes_as_the_merged_model(exported, spm_dir):
    """Held-out chat prompts with indentation and text that needs the byte fallback."""
    from transformers import AutoTokenizer

    root, printed, _, _ = exported
    words = ["import", "return", "naïve", "self", "while", "lambda", "yield", "größe", "raise", "日本"]
    prompts = [f"[INST]{words[i % 10]}:\n    {words[(3 * i + 1) % 10]}_{i}([/INST]" for i in range(20)]
    assert_completes_as_merged(root, prompts, held_out_ids(len(AutoTokenizer.from_pretrained(spm_dir)), low=300))
    assert "tokenizer llama (SentencePiece-style, byte fallback, add_space_prefix True) with" in printed


def test_the_modelfile_has_mistrals_template_and_stop_tokens(exported):
    root = exported[0]
    assert (root / "gguf" / "Modelfile").read_text() == MISTRAL_MODELFILE


def test_a_tokenizer_llama_cpp_would_split_otherwise_is_refused_before_the_checkpoint_loads(
    exported, spm_dir, tmp_path, monkeypatch, capsys
):
    fail_if_called(monkeypatch, ["pl_lowprec.cli.export.restore"], "the checkpoint was restored")
    _, _, checkpoint, args = exported
    broken = tmp_path / "broken_tokenizer"
    shutil.copytree(spm_dir, broken)
    tokenizer_json = json.loads((broken / "tokenizer.json").read_text())
    tokenizer_json["model"]["merges"].remove(["▁", "▁"])
    (broken / "tokenizer.json").write_text(json.dumps(tokenizer_json))
    out = tmp_path / "gguf"
    message = r"broken_tokenizer' is a SentencePiece-style BPE \(byte fallback\).* '▁' \+ '▁' -> '▁▁' is not one of"
    command = ["export", f"--ckpt_path={checkpoint}", f"--out={out}", *args, "--format=gguf"]
    assert re.search(message, refusal_line(capsys, [*command, f"--data.tokenizer={broken}"]))
    assert not out.exists()


# --- refusals: what llama.cpp's SentencePiece tokenizer would split differently -----------------------------------


def refused(tokenizer_json, source="tok"):
    from pl_lowprec.export.gguf_vocab import check_tokenizer_json

    with pytest.raises(ValueError) as error:
        check_tokenizer_json(tokenizer_json, source, 10**6)
    return str(error.value)


def test_tokenizers_llama_cpp_would_split_otherwise_are_refused_with_the_reason(spm_dir):
    from pl_lowprec.export.gguf_vocab import check_tokenizer_json

    tokenizer_json = json.loads((spm_dir / "tokenizer.json").read_text())
    model = tokenizer_json["model"]
    assert check_tokenizer_json(tokenizer_json, "tok", 10**6) == "llama"
    # a merge left out: llama.cpp would still merge "▁" + "▁" (any two pieces forming a token)
    merges = [m for m in model["merges"] if m != ["▁", "▁"]]
    message = refused({**tokenizer_json, "model": {**model, "merges": merges}})
    assert "'▁' + '▁' -> '▁▁' is not one of its merges, though all three are tokens" in message
    assert message.startswith("The tokenizer of 'tok' is a SentencePiece-style BPE (byte fallback)")
    assert message.endswith("Export --format merged and convert with llama.cpp's convert_hf_to_gguf.py.")
    vocab = {k: v for k, v in model["vocab"].items() if k != "<0x0A>"}
    message = refused({**tokenizer_json, "model": {**model, "vocab": vocab}})
    assert "lacks 1 of the 256 byte tokens (<0x0A>...)" in message
    split = {"type": "Metaspace", "replacement": "▁", "prepend_scheme": "first", "split": True}
    assert "splits text otherwise than SentencePiece" in refused({**tokenizer_json, "pre_tokenizer": split})
    assert "sets dropout=0.1" in refused({**tokenizer_json, "model": {**model, "dropout": 0.1}})
    unigram = {"type": "Unigram", "unk_id": 0, "vocab": [["<unk>", 0.0], ["▁a", -1.0]], "byte_fallback": True}
    message = refused({**tokenizer_json, "model": unigram})
    assert "is a Unigram model: llama.cpp's SentencePiece tokenizer merges pairs by score" in message


def test_merges_apart_in_rank_are_accepted_only_where_llama_cpp_still_merges_alike(spm_dir):
    """transformers 5 ranks the merges of tokens SentencePiece scores alike (Mistral's runs of spaces, all -1e9) by
    the pieces' lengths, interleaving them: no score per token gives that order, yet llama.cpp splits every text
    of those pieces alike, so the tokenizer is written. Where it would not, the refusal shows a text it splits
    otherwise."""
    from transformers import AutoTokenizer
    from transformers.tokenization_utils_base import generate_merges

    from pl_lowprec.export.gguf_merge_order import first_merge_ranks, interleaved_pieces, merge_problem

    tokenizer_json = json.loads((spm_dir / "tokenizer.json").read_text())
    model = tokenizer_json["model"]
    first = first_merge_ranks([tuple(m) for m in model["merges"]])
    scores = {token: -1e9 if token in WHITESPACE else -first.get(token, 10**6) for token in model["vocab"]}
    tied = [list(m) for m in generate_merges(model["vocab"], scores)]
    assert interleaved_pieces([tuple(m) for m in tied]) >= set(WHITESPACE[:3])  # apart in rank: probed
    tied_json = {**tokenizer_json, "model": {**model, "merges": tied}}
    assert merge_problem(model["vocab"], [tuple(m) for m in tied]) is None
    tied_dir = spm_dir.with_name("tied")
    shutil.copytree(spm_dir, tied_dir)
    (tied_dir / "tokenizer.json").write_text(json.dumps(tied_json))
    tokenizer = AutoTokenizer.from_pretrained(tied_dir)
    ranks = first_merge_ranks([tuple(m) for m in tied])
    vocab = sorted(model["vocab"], key=model["vocab"].get)
    llama_cpp = LlamaCppSpm(vocab, [-float(ranks.get(t, 10**6)) for t in vocab], [1] * len(vocab))
    for spaces in range(1, 40):
        text = f"x{' ' * spaces}y"
        assert llama_cpp.tokenize(text) == tokenizer(text)["input_ids"], spaces

    # abc's merges at ranks 1 and 3 with bcd's at 2: llama.cpp, scoring abc by its first rank, prefers it
    vocab = {token: index for index, token in enumerate(["a", "b", "c", "d", "bc", "ab", "abc", "bcd"])}
    merges = [("b", "c"), ("ab", "c"), ("bc", "d"), ("a", "bc"), ("a", "b")]
    problem = merge_problem(vocab, merges)
    assert problem.endswith("llama.cpp would split 'abcd' into ['abc', 'd'] where the merges give ['a', 'bcd']")


def test_legacy_and_metaspace_splittings_set_the_space_prefix():
    from pl_lowprec.export.gguf_vocab_spm import space_prefix

    replace = {"type": "Replace", "pattern": {"String": " "}, "content": "▁"}
    prepend = {"type": "Prepend", "prepend": "▁"}
    legacy = {"normalizer": {"type": "Sequence", "normalizers": [prepend, replace]}, "pre_tokenizer": None}
    assert space_prefix(legacy) is True
    assert space_prefix({"normalizer": replace, "pre_tokenizer": None}) is False
    for scheme, prefix in (("first", True), ("always", True), ("never", False)):
        metaspace = {"type": "Metaspace", "replacement": "▁", "prepend_scheme": scheme, "split": False}
        assert space_prefix({"normalizer": None, "pre_tokenizer": metaspace}) is prefix
    assert space_prefix({"normalizer": None, "pre_tokenizer": {"type": "Whitespace"}}) is None
