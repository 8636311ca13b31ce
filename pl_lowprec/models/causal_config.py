"""``CausalLM(pretrained=...)`` of a checkpoint that is not a causal LM, refused when the config is read.

``AutoModelForCausalLM.from_config`` builds a causal LM of any config whose ``model_type`` has one: a BERT
classifier's becomes a ``BertLMHeadModel`` (transformers warns "add is_decoder=True") with a language-model head
the checkpoint lacks. ``fit`` refused it only once the weights streamed in, as a list of missing and unexpected
keys; ``pl-lowprec estimate`` and ``plan`` estimated it without a word. A model whose ``config.json`` names only
classes that cannot generate, or whose ``model_type`` has no causal LM in transformers, is refused here instead,
before anything is built.
"""

from __future__ import annotations

from typing import Any

from pl_lowprec.export.generates_text import none_generates


def check_causal_lm_config(config: Any, pretrained: str) -> None:
    """``ValueError`` naming the checkpoint's class where ``config`` (a transformers ``PretrainedConfig``) is not
    a causal LM's."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    names = list(getattr(config, "architectures", None) or [])
    model_type = getattr(config, "model_type", None)
    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        what = f"a {names[0]}" if names else f"a model of model_type {model_type!r}"
        why = f"transformers has no causal LM for model_type {model_type!r} (AutoModelForCausalLM)"
    elif none_generates(names):
        what = f"a {names[0]} (config.json's architectures)"
        why = (
            f"AutoModelForCausalLM would build a {MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type]} of its config,"
            " with a next-token head the checkpoint does not have"
        )
    else:
        return
    raise ValueError(
        f"CausalLM(pretrained={pretrained!r}) is {what}, not a causal LM: {why}. CausalLM trains next-token"
        " prediction; name a checkpoint trained as one (architectures ...ForCausalLM). To fine-tune this model"
        " as it is, write a LightningModule that builds it (the strategy's quantization and LoRA apply to any"
        " module: pretrained= goes to the strategy)."
    )
