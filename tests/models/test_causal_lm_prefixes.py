"""CausalLM loads a checkpoint whose keys lack its ``model.`` (a base model's, ``AutoModel.save_pretrained``) or carry
a peft wrapper's ``base_model.model.``, as ``from_pretrained`` loads both: the prefix under which every key fits is
taken and said. CausalLM has no ``pretrained_prefix`` argument, and it was refused, advising that argument."""

from __future__ import annotations

import logging

import pytest
import torch
from lightning_helpers import quiet_trainer
from loading_helpers import rewrite_weights, save_llama

from pl_lowprec import LowPrecisionStrategy
from pl_lowprec.models import CausalLM

pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory):
    """Tied embeddings, as SmolLM2's and Qwen2.5's: a base model's checkpoint then holds every weight."""
    return save_llama(tmp_path_factory.mktemp("pretrained"), hidden_size=32, layers=1, tie=True)


def _renamed(pretrained, target, rename):
    """The same weights, every key renamed: what another wrapper's ``save_pretrained`` writes."""
    return rewrite_weights(pretrained, lambda state: {rename(k): v for k, v in state.items()}, copy_to=target)


def _loaded(directory, strategy):
    model = CausalLM(str(directory))
    trainer = quiet_trainer(max_steps=0, **({"strategy": strategy} if strategy else {}))
    trainer.strategy._lightning_module = model  # what fit does before configure_model
    model.trainer = trainer
    model.configure_model()
    if strategy is not None:
        strategy.transform.apply(model, trainer.precision_plugin, torch.device("cpu"))
    return model


@pytest.mark.parametrize("plain", [True, False], ids=["plain_strategy", "lowprec"])
@pytest.mark.parametrize(
    ("layout", "rename", "taken"),
    [
        ("peft_wrapper", lambda key: f"base_model.model.{key}", "{'base_model.': ''}"),
        ("base_model", lambda key: key.removeprefix("model."), "'model.model.'"),
    ],
)
def test_a_checkpoint_under_another_prefix_loads_the_weights_from_pretrained_loads(
    pretrained, tmp_path, caplog, plain, layout, rename, taken
):
    from transformers import AutoModelForCausalLM

    directory = _renamed(pretrained, tmp_path / layout, rename)
    reference = AutoModelForCausalLM.from_pretrained(pretrained)  # the original layout
    with caplog.at_level(logging.INFO, logger="lightning.pytorch.utilities.rank_zero"):
        model = _loaded(directory, None if plain else LowPrecisionStrategy())
    said = [r.getMessage() for r in caplog.records if "took pretrained_prefix=" in r.getMessage()]
    assert said and f"took pretrained_prefix={taken}, not the usual 'model.'" in said[0], said
    assert "name pretrained_prefix" not in said[0]  # CausalLM takes no pretrained_prefix
    for key, value in reference.state_dict().items():
        assert torch.equal(model.model.state_dict()[key], value), key


def test_the_usual_prefix_is_taken_without_a_word(pretrained, caplog):
    with caplog.at_level(logging.INFO, logger="lightning.pytorch.utilities.rank_zero"):
        _loaded(pretrained, LowPrecisionStrategy())
    assert not [r for r in caplog.records if "took pretrained_prefix=" in r.getMessage()]


def test_a_base_model_without_its_output_head_is_refused_saying_so(tmp_path):
    """An untied model's base saved alone (AutoModel.save_pretrained) lacks lm_head: from_pretrained starts it at
    random with a warning; here the load is refused, naming the head and what such a checkpoint is."""
    untied = save_llama(tmp_path / "untied", hidden_size=32, layers=1)
    directory = _renamed(untied, tmp_path / "base", lambda key: key.removeprefix("model."))
    state = safetensors_torch.load_file(directory / "model.safetensors")
    del state["lm_head.weight"]
    safetensors_torch.save_file(state, directory / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"Missing from the checkpoint: model.lm_head.weight. .*a base model's"):
        _loaded(directory, None)
