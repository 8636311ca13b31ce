"""The data's tokenizer is checked against the model before step 0, on the user's path (pl-lowprec fit)."""

import re

import pytest
from loading_helpers import causal_lm_fit_args, save_llama, save_pretrained_dir, save_tokenizer, write_prompt_completion

from pl_lowprec.cli import main
from pl_lowprec.models.tokenizer_check import check_tokenizer

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tokenizers")
    return save_pretrained_dir(tmp / "model"), write_prompt_completion(tmp / "pc.jsonl"), tmp


def fit(model_dir, data, tokenizer, root):
    main(
        [*causal_lm_fit_args(model_dir, data, tokenizer), f"--trainer.default_root_dir={root}", "--trainer.max_steps=1"]
    )


def refusal(capsys, *fit_args) -> str:
    """pl-lowprec stops before the first step: exit status 2 and one paragraph on stderr, no traceback."""
    with pytest.raises(SystemExit) as exit_info:
        fit(*fit_args)
    assert exit_info.value.code == 2
    message = capsys.readouterr().err
    assert "Traceback" not in message and "fit stopped before its first step" in message
    return " ".join(message.split())


def test_a_larger_vocabulary_is_refused_with_both_sizes(model, tmp_path, capsys):
    model_dir, data, tmp = model
    larger = save_tokenizer(tmp / "larger", vocab_size=400)
    message = refusal(capsys, model_dir, data, larger, tmp_path)
    assert (
        f"--data.tokenizer '{larger}' has 400 tokens with ids up to 399, but the model has 320 embedding rows"
        in message
    )
    assert "80 ids have no row" in message and f"--data.tokenizer '{model_dir}'" in message
    assert not any(tmp_path.rglob("*.ckpt"))  # refused before step 0


def test_another_vocabulary_of_the_same_size_is_refused(model, tmp_path, capsys):
    from pl_lowprec.demo.stdlib_text import stdlib_bytes
    from pl_lowprec.demo.tokenizer import train_tokenizer

    model_dir, data, tmp = model
    other = tmp / "other"
    train_tokenizer([stdlib_bytes(100_000).decode("utf-8", "replace")[::-1]], 320).save_pretrained(other)
    message = refusal(capsys, model_dir, data, other, tmp_path)
    assert re.search(r"is not the tokenizer saved with the model in .*ids name other tokens there", message), message
    assert not any(tmp_path.rglob("*.ckpt"))


def test_a_tokenizer_mismatch_is_said_before_the_truncation_it_causes(model, tmp_path, capsys):
    """At a seq_len that truncates the records, another model's tokenizer is the cause to report first: following
    the truncation refusal's advice (a longer seq_len) would only lead to it."""
    from pl_lowprec.demo.stdlib_text import stdlib_bytes
    from pl_lowprec.demo.tokenizer import train_tokenizer

    model_dir, data, tmp = model
    other = tmp / "other_for_truncation"
    train_tokenizer([stdlib_bytes(100_000).decode("utf-8", "replace")[::-1]], 320).save_pretrained(other)
    short = ["--data.seq_len=16"]
    with pytest.raises(SystemExit):  # the model's own tokenizer at this seq_len: the truncation refusal
        main([*causal_lm_fit_args(model_dir, data, model_dir), f"--trainer.default_root_dir={tmp_path}", *short])
    assert "seq_len=16 cuts" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main([*causal_lm_fit_args(model_dir, data, other), f"--trainer.default_root_dir={tmp_path}", *short])
    message = capsys.readouterr().err
    assert "is not the tokenizer saved with the model in" in message and "seq_len=16" not in message, message


def test_padded_embeddings_and_the_models_own_tokenizer_pass(model, tmp_path):
    from transformers import AutoConfig, AutoTokenizer

    model_dir, data, tmp = model
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    padded = save_llama(tmp / "padded", hidden_size=32, layers=1, vocab_size=384)  # rows past the vocabulary
    check_tokenizer(tokenizer, str(model_dir), AutoConfig.from_pretrained(padded), padded)
    copy = tmp / "copy"  # the same tokenizer saved elsewhere: same ids, accepted
    tokenizer.save_pretrained(copy)
    check_tokenizer(tokenizer, str(copy), AutoConfig.from_pretrained(model_dir), model_dir)
    fit(model_dir, data, model_dir, tmp_path)


def test_the_models_own_tokenizer_past_its_rows_is_not_told_to_use_itself(tmp_path):
    """transformers loads a directory's tokenizer by the config's model_type, which can add a token past the rows:
    the refusal says so, instead of advising the very directory it was given (with 'tokenizer' said twice)."""
    from transformers import AutoTokenizer, LlamaConfig

    directory = save_tokenizer(tmp_path / "model", vocab_size=400)
    tokenizer = AutoTokenizer.from_pretrained(directory)
    with pytest.raises(ValueError) as refused:
        check_tokenizer(tokenizer, str(directory), LlamaConfig(vocab_size=320), directory)
    message = str(refused.value)
    assert "It is the model directory's own, as transformers loads it" in message
    assert f"--data.tokenizer {str(directory)!r})" not in message and "tokenizer tokenizer" not in message
    with pytest.raises(ValueError) as other:  # another directory's: told to use the model's own, named once
        check_tokenizer(tokenizer, str(directory), LlamaConfig(vocab_size=320), tmp_path / "elsewhere")
    assert f"Use the model's own tokenizer (--data.tokenizer '{tmp_path / 'elsewhere'}')," in str(other.value)


def test_a_missing_tokenizer_path_is_refused_as_the_tokenizer_not_as_pretrained(tmp_path):
    from pl_lowprec.loading.tokenizer import load_tokenizer

    with pytest.raises(ValueError, match=r"^tokenizer='[^']*nowhere' is neither a model directory nor a hub id"):
        load_tokenizer(tmp_path / "nowhere")
