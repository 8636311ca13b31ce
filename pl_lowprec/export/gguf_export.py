"""``pl-lowprec export --format gguf``: the merged model as one GGUF file, with an Ollama ``Modelfile`` beside it.

    pl-lowprec export --ckpt_path runs/.../last.ckpt --out runs/gguf --format gguf --gguf_type q8_0

The merge is the ``--format merged`` export itself (``write.export``), written to a temporary directory inside
``--out`` and removed once the GGUF is written, so the GGUF holds exactly the weights a merged export holds
(``gguf_convert``). Everything that can be refused is refused before the checkpoint loads: the type, a missing
``gguf`` package, an architecture or tokenizer llama.cpp would not compute or split as transformers does.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

from pl_lowprec._imports import gguf_missing, import_gguf
from pl_lowprec.export.gguf_arch import architecture
from pl_lowprec.export.gguf_convert import auto_type, convert_to_gguf, model_config
from pl_lowprec.export.gguf_types import FALLBACK, check_gguf_type
from pl_lowprec.export.gguf_vocab import check_tokenizer
from pl_lowprec.export.modelfile import chat_parts, modelfile, verified_template
from pl_lowprec.export.out_paths import prepare_out_dir
from pl_lowprec.export.restore import Restored
from pl_lowprec.export.write import check_merged, export, pretrained_dir, read_paths
from pl_lowprec.loading import PretrainedWeights
from pl_lowprec.loading.hub import local_or_downloaded
from pl_lowprec.loading.sources import weight_files
from pl_lowprec.loading.tokenizer import load_tokenizer


def fallback_pairs(written_types: list[str]) -> str:
    """llama-quantize's fallbacks that gave ``written_types``, in words: ``Q4_K -> Q5_0, Q6_K -> Q8_0``."""
    pairs = []
    for target in written_types:
        sources = [kind for kind, fallback in FALLBACK.items() if fallback == target]
        if target == "F16":
            pairs.append("F16 where a row does not split into 32 values either")
        elif sources:
            pairs.append(f"{' or '.join(sources)} -> {target}")
    return ", ".join(pairs)


def requested_types(gguf_type: str | None) -> list[str]:
    """``--gguf_type q4_k_m,q8_0``: the types in the order given (``auto`` where none is), each checked."""
    if not (gguf_type or "").strip():
        return ["auto"]
    requested = [part.strip() for part in gguf_type.split(",")]
    if "" in requested:  # a type deleted from the list, or a typo: not to be guessed
        written = ",".join(part for part in requested if part)
        raise ValueError(
            f"--gguf_type '{gguf_type}' has an empty item between its commas. Name the types separated by single"
            f" commas: --gguf_type {written}."
        )
    for name in requested:
        if name != "auto":
            check_gguf_type(name)
    return requested


def check_gguf_request(gguf_type: str | None, dtype: str | None) -> None:
    """The arguments alone: types this export writes, no ``--dtype``, and the ``gguf`` package installed."""
    requested = requested_types(gguf_type)
    if dtype is not None:
        raise ValueError(
            f"--dtype {dtype} sets the dtype of a --format merged export; a GGUF's tensors are written in"
            f" --gguf_type ({','.join(requested)}, norms and biases in F32). Leave out --dtype."
        )
    missing = gguf_missing()
    if missing is not None:
        raise ValueError(f"--format gguf writes the file with llama.cpp's gguf package: {missing}")


def check_gguf_sources(weights: PretrainedWeights | None, tokenizer_dir: str | None) -> None:
    """The rebuilt run's model config and tokenizer (``restore.sources``), before its weights load: an architecture
    llama.cpp computes as transformers does, and a tokenizer it splits as the one the model learned."""
    if weights is None or not (Path(weights.path) / "config.json").is_file():
        return  # check_export and check_merged refuse these with their own message
    directory = Path(weights.path)
    check_convertible(model_config(directory), tokenizer_dir or directory)


def check_convertible(config: Any, tokenizer_source: str | Path) -> None:
    """An architecture llama.cpp computes as transformers does, and a tokenizer it splits as the one the model
    learned (both commands check it before anything loads or is written)."""
    architecture(config)
    check_tokenizer(load_tokenizer(tokenizer_source), tokenizer_source, config.vocab_size)


def export_gguf(
    restored: Restored, out: Path, gguf_type: str | None, overwrite: bool, inputs: dict | None = None
) -> str:
    """Write ``out/model-<type>.gguf`` for each of ``--gguf_type``'s types (``q4_k_m,q8_0``: one merge, a file
    each) and ``out/Modelfile`` (for the first); return the summary the command prints. ``auto`` is the merged
    weights' 16-bit type (bf16 or f16; f16 from float32, as llama.cpp's converter picks)."""
    requested = requested_types(gguf_type)
    import_gguf()
    check_merged(restored, "--format gguf")
    prepare_out_dir(out, overwrite, read_paths(restored.checkpoint, restored.weights, restored.tokenizer_dir, inputs))
    base = pretrained_dir(restored)
    source = f"{restored.checkpoint}" + (f" merged into {base}" if base is not None else "")
    with tempfile.TemporaryDirectory(dir=out, prefix=".merged-") as merged:
        export(restored, Path(merged), merged=True, dtype=None, overwrite=False, inputs=inputs)
        return write_ggufs(Path(merged), out, requested, source, name=out.resolve().name)


def check_model_for_gguf(model_dir: Path) -> None:
    """``export --model DIR``: a Hugging Face model directory in full precision, with its tokenizer, of an
    architecture llama.cpp computes as transformers does (checked before anything is written)."""
    if not (model_dir / "config.json").is_file():
        adapter = (model_dir / "adapter_config.json").is_file()
        why = "is a peft adapter" if adapter else "holds no config.json" if model_dir.is_dir() else "is not a directory"
        raise ValueError(
            f"--model {str(model_dir)!r} {why}: --model converts a model directory (config.json, safetensors or"
            " pytorch_model.bin, and the tokenizer; a `pl-lowprec export --merged` output is one) to GGUF. For a"
            " training checkpoint pass --ckpt_path instead, which merges the adapters first."
        )
    config = model_config(model_dir)
    if getattr(config, "quantization_config", None):
        raise ValueError(
            f"--model {str(model_dir)!r} holds quantized weights (config.json has a quantization_config); GGUF is"
            " written from full-precision weights: convert the unquantized model, or a `pl-lowprec export --merged`"
            " of the checkpoint."
        )
    check_convertible(config, model_dir)


def convert_model_dir(model: str, out: Path, gguf_type: str | None, overwrite: bool) -> str:
    """``export --model DIR --format gguf``: a model directory as it is (no checkpoint, nothing merged), or a hub
    id such as ``Qwen/Qwen2.5-0.5B-Instruct``, downloaded where there is network."""
    requested = requested_types(gguf_type)
    import_gguf()
    model_dir = local_or_downloaded(model)
    check_model_for_gguf(model_dir)
    prepare_out_dir(out, overwrite, {"model directory": model_dir})
    return write_ggufs(model_dir, out, requested, model, name=model_name(model))


def model_name(model: str) -> str:
    """``general.name`` of a converted model: its directory's or hub id's last part (``Qwen2.5-0.5B-Instruct``), as
    llama.cpp's converter names a file after the directory it reads. A checkpoint's export is named after ``--out``,
    the directory its merged model would have been written to."""
    return Path(model.rstrip("/")).resolve().name if Path(model).is_dir() else model.rstrip("/").split("/")[-1]


def write_ggufs(model_dir: Path, out: Path, requested: list[str], source: str, name: str) -> str:
    """Each requested type of ``model_dir`` as ``out/model-<type>.gguf``, the ``Modelfile`` for the first, and the
    summary: a paragraph for the first file, a line for each other. ``name`` is the files' ``general.name``."""
    files = []
    with weight_files() as weights:  # a .bin shard is unpickled once for every type
        resolved = [auto_type(model_dir, weights) if asked == "auto" else asked for asked in requested]
        for gguf_type in dict.fromkeys(resolved):  # each once (auto may resolve to a type also asked for)
            gguf_file = out / f"model-{gguf_type}.gguf"
            files.append((gguf_file, convert_to_gguf(model_dir, gguf_file, gguf_type, name)))
    tokenizer = load_tokenizer(model_dir)
    (gguf_file, written), others = files[0], files[1:]
    vocab = written["vocab"]
    parts = chat_parts(tokenizer, add_bos=bool(vocab["add_special"].get("bos")))
    template = verified_template(tokenizer, parts)
    stops = parts.stops(tokenizer.eos_token) if parts is not None else [tokenizer.eos_token]
    (out / "Modelfile").write_text(modelfile(gguf_file.name, template, stops), encoding="utf-8")
    first = summary(written, gguf_file, out / "Modelfile", template, stops, source)
    return "\n".join([first, *(also_wrote(other, file, out / "Modelfile") for file, other in others)])


def also_wrote(written: dict[str, Any], gguf_file: Path, modelfile_path: Path) -> str:
    """The line of each further type: the same weights and tokenizer in another type."""
    return (
        f"Also wrote {gguf_file} ({gguf_file.stat().st_size / 2**20:,.1f} MiB, {written['tensors']} tensors:"
        f" {types_note(written)}; the same weights, tokenizer and chat template).{fallback_note(written)} Run it"
        f" with: llama-cli -m {gguf_file}, or ollama create NAME -f {modelfile_path} with its FROM line set to"
        f" ./{gguf_file.name}."
    )


def types_note(written: dict[str, Any]) -> str:
    return ", ".join(f"{count} {name}" for name, count in sorted(written["types"].items()))


def fallback_note(written: dict[str, Any]) -> str:
    """The sentence on a k-quant mix's fallbacks, where the file took any."""
    if not written["k_fallbacks"]["rows"]:
        return ""
    rows = ", ".join(f"{count} with rows of {width}" for width, count in written["k_fallbacks"]["rows"].items())
    return (
        f" Matrices whose rows do not split into 256-value k-quant super-blocks ({rows}) are written in"
        f" llama-quantize's fallback types ({fallback_pairs(written['k_fallbacks']['types'])}), as it writes them."
    )


def tokenizer_note(vocab: dict[str, Any]) -> str:
    """The tokenizer part of the summary: llama.cpp's model/pre names, the tokens and what orders the merging."""
    if vocab["model"] == "llama":
        return (
            f"llama (SentencePiece-style, byte fallback, add_space_prefix {vocab['add_space_prefix']}) with"
            f" {vocab['tokens']} tokens, scored by rank in {vocab['merges']} merges"
        )
    return f"gpt2/{vocab['pre']} with {vocab['tokens']} tokens and {vocab['merges']} merges"


def summary(
    written: dict[str, Any], gguf_file: Path, modelfile_path: Path, template: str | None, stops: list[str], source: str
) -> str:
    """One paragraph: what the file holds, what the Modelfile holds, where it came from, how to run it."""
    vocab, config = written["vocab"], written["config"]
    types = types_note(written)
    specials = ", ".join(f"{kind} {index}" for kind, index in sorted(vocab["special_ids"].items()))
    if template is not None:
        template_note = "TEMPLATE converted from the chat template and checked on 5 conversations"
    elif vocab["chat_template"]:
        template_note = (
            "no TEMPLATE: the chat template is not fixed strings around each turn, so Ollama chooses one from the"
            " file's tokenizer.chat_template"
        )
    else:
        template_note = "no TEMPLATE: the tokenizer has no chat template (plain completion)"
    window = getattr(config, "sliding_window", None)
    window_note = ""
    if window and getattr(config, "use_sliding_window", True) and window < config.max_position_embeddings:
        window_note = (
            f" Note: the model's sliding_window={window} is not in the file: llama.cpp's"
            f" {written['architecture']} attends to the whole context, as its own converter leaves it."
        )
    return (
        f"Wrote {gguf_file} ({written['architecture']}, {gguf_file.stat().st_size / 2**20:,.1f} MiB,"
        f" {written['tensors']} tensors: {types}; tokenizer {tokenizer_note(vocab)}, {specials}, add_bos"
        f" {bool(vocab['add_special'].get('bos'))}; chat template"
        f" {'included' if vocab['chat_template'] else 'none'}) and {modelfile_path} ({template_note}; stop"
        f" {', '.join(repr(s) for s in stops)}) from {source}.{fallback_note(written)}{window_note} Run it with:"
        f" ollama create NAME -f {modelfile_path}, or llama-cli -m {gguf_file}."
    )
