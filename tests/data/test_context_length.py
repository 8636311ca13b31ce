"""``seq_len`` against the model's context: past a model's learned positions it is refused before any record is
read (a longer sample failed inside the model with 'index out of range'); past a rotary model's trained positions
a warning says so."""

from __future__ import annotations

import warnings
from types import SimpleNamespace

import pytest
from loading_helpers import LlamaModule, causal_lm_fit_args, save_tokenizer

from pl_lowprec.cli import main
from pl_lowprec.data.context_length import check_seq_len_with_model

transformers = pytest.importorskip("transformers")


def test_a_seq_len_past_learned_positions_is_refused_on_the_users_path(tmp_path, capsys):
    pretrained = save_tokenizer(tmp_path / "gpt2")
    vocab = len(transformers.AutoTokenizer.from_pretrained(pretrained))
    config = transformers.GPT2Config(vocab_size=vocab, n_positions=32, n_embd=32, n_layer=1, n_head=2)
    transformers.GPT2LMHeadModel(config).save_pretrained(pretrained)
    data = tmp_path / "data.txt"  # text is cut into blocks of seq_len: every sample is 64 tokens long
    data.write_text("def add(a, b):\n    return a + b\n" * 200)
    with pytest.raises(SystemExit) as exited:
        main([*causal_lm_fit_args(pretrained, data), "--data.seq_len=64", "--trainer.max_steps=1"])
    err = capsys.readouterr().err
    assert exited.value.code == 2
    assert "seq_len=64) is past the model's 32 learned positions (gpt2: max_position_embeddings=32)" in err
    assert "Pass --data.seq_len 32 or less." in err


def test_a_seq_len_past_rotary_positions_is_said_and_within_them_nothing():
    trainer = SimpleNamespace(lightning_module=LlamaModule())  # llama_config: max_position_embeddings=64
    with pytest.warns(UserWarning, match=r"seq_len=128\) is past the model's max_position_embeddings=64 \(llama\)"):
        check_seq_len_with_model(trainer, 128)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_seq_len_with_model(trainer, 64)
