"""``pl-lowprec generate`` stops where transformers' own ``generate`` stops (the model's ``generation_config`` EOS
ids) and at the chat template's end of turn, as the GGUF export's Modelfile does: it passed only the tokenizer's
EOS, and a model whose turn ends at another token (``<|im_end|>`` beside ``</s>``) wrote on to max_new_tokens."""

from __future__ import annotations

import pytest
import torch
from loading_helpers import save_llama, save_tokenizer

from pl_lowprec.export.generate import Decoding, Generator
from pl_lowprec.export.stop_tokens import stop_token_ids

pytest.importorskip("transformers")

CHATML = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture(scope="module")
def chatml(tmp_path_factory):
    """A tokenizer whose EOS is ``</s>`` and whose chat turns end at ``<|im_end|>`` (Qwen2.5 base's layout), and
    a Llama of its vocabulary."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    directory = save_tokenizer(tmp_path_factory.mktemp("chatml"))
    tokenizer = AutoTokenizer.from_pretrained(directory)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tokenizer.chat_template = CHATML
    tokenizer.save_pretrained(directory)
    save_llama(directory, hidden_size=32, layers=1, vocab_size=len(tokenizer))
    return AutoModelForCausalLM.from_pretrained(directory).eval(), AutoTokenizer.from_pretrained(directory)


def always(model, token: int):
    """Make ``model`` pick ``token`` at every position (a hook on its head), as a model that ends its turn at once."""

    def prefer(module, args, logits):
        logits = logits.clone()
        logits[..., token] = logits.abs().amax() + 10
        return logits

    return model.lm_head.register_forward_hook(prefer)


def chat_prompt(tokenizer) -> list[int]:
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "x = 1"}], tokenize=False, add_generation_prompt=True
    )
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def generated(model, tokenizer, ids: list[int], max_new_tokens: int = 8) -> list[int]:
    """The new ids of ``Generator``'s ``generate`` call for one prompt."""
    seen: list[torch.Tensor] = []
    original = model.generate

    def recording(*args, **kwargs):
        out = original(*args, **kwargs)
        seen.append(out[0, len(ids) :])
        return out

    model.generate = recording
    try:
        Generator(model, tokenizer).complete_ids([ids], Decoding(max_new_tokens=max_new_tokens))
    finally:
        del model.generate
    return seen[0].tolist()


def test_the_chat_templates_end_of_turn_stops_generation(chatml):
    model, tokenizer = chatml
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert tokenizer.eos_token == "</s>" and end != tokenizer.eos_token_id
    stops = stop_token_ids(model, tokenizer)
    assert stops[-2:] == [tokenizer.eos_token_id, end] and len(set(stops)) == len(stops)
    handle = always(model, end)
    try:
        assert generated(model, tokenizer, chat_prompt(tokenizer)) == [end]  # ran on to 8 tokens of <|im_end|> before
    finally:
        handle.remove()


def test_the_generation_configs_eos_ids_stop_generation(chatml, monkeypatch):
    """Instruct models list several ids (Llama-3.x-Instruct three): each stops, as in transformers' generate."""
    model, tokenizer = chatml
    monkeypatch.setattr(tokenizer, "chat_template", None)
    other = 7  # a plain token that only the generation config names
    monkeypatch.setattr(model.generation_config, "eos_token_id", [other, tokenizer.eos_token_id])
    assert stop_token_ids(model, tokenizer) == [other, tokenizer.eos_token_id]
    handle = always(model, other)
    try:
        assert generated(model, tokenizer, tokenizer("x = 1")["input_ids"], max_new_tokens=4) == [other]
    finally:
        handle.remove()
