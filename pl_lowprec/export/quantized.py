"""What ``pl-lowprec export`` writes for a run trained with ``qat=``: the model converted to torchao's quantized
form, as the run's own ``fit`` converts it when it ends, which exists only in that process.

A QAT checkpoint holds the fake-quantized model's float weights (its quantizers keep no state), so the export
restores it, folds any LoRA adapters into their base layers and converts the same layers with the same torchao
config (``convert_qat``). The state dict of torchao tensors goes to ``quantized_model.pt``; beside it the Hugging
Face config and the training data's tokenizer, so the model is rebuilt with ``from_config`` and takes the
tensors with ``load_state_dict(..., assign=True)``.
"""

from __future__ import annotations

from pathlib import Path

import torch

from pl_lowprec.adapters import held_hf_model
from pl_lowprec.export.out_paths import prepare_out_dir
from pl_lowprec.export.restore import Restored
from pl_lowprec.export.write import read_paths, save_tokenizer, saved_tokenizer_note
from pl_lowprec.transforms.qat import convert_qat

QUANTIZED_FILE = "quantized_model.pt"


def check_qat_export(export_format: str, asked: str) -> None:
    """A QAT run's export is its quantized model: an adapter alone, a merge into bf16 weights or a GGUF file
    would each drop what QAT trained for (the quantized weights it rounds to)."""
    if export_format != "adapter":
        raise ValueError(
            f"This run trained with qat=, and {asked} asks for another export than its quantized model: merged"
            " bf16 weights or a GGUF file would be quantized again by another scheme than the one QAT trained for."
            f" Leave out {asked}: the export then writes the model converted to its torchao form ({QUANTIZED_FILE})."
        )


def export_quantized(restored: Restored, out: Path, overwrite: bool, inputs: dict | None = None) -> str:
    """Convert the restored QAT model and write it to ``out``; the line that says what and how to load it."""
    qat = restored.transform.config.qat
    read = read_paths(restored.checkpoint, restored.weights, restored.tokenizer_dir, inputs)
    prepare_out_dir(out, overwrite, read)
    converted = convert_qat(restored.module, qat)
    hf_model = held_hf_model(restored.module)
    target = hf_model if hf_model is not None else restored.module
    torch.save(target.state_dict(), out / QUANTIZED_FILE)
    if hf_model is not None:
        hf_model.config.save_pretrained(str(out))
    tokenizer = save_tokenizer(restored, out)
    load = (
        f"AutoModelForCausalLM.from_config(AutoConfig.from_pretrained({str(out)!r})).load_state_dict(torch.load("
        f"{str(out / QUANTIZED_FILE)!r}, weights_only=True), assign=True), with torchao imported"
        if hf_model is not None
        else f"{type(restored.module).__name__}(...).load_state_dict(torch.load(..., weights_only=True), assign=True)"
    )
    return (
        f"Wrote the QAT model converted to {qat.scheme} ({len(converted)} linear layers as torchao tensors) to"
        f" {out / QUANTIZED_FILE} from {restored.checkpoint}"
        f" ({saved_tokenizer_note(tokenizer)}). Load it: {load}."
    )
