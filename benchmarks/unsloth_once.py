"""Unsloth's QLoRA in a fresh process, with the settings of ``train_once.py --stack hf``; prints one ``RESULT {json}``.

python benchmarks/unsloth_once.py --pretrained DIR [--batch 2] [--seq 2048] [--steps 8] [--lora-r 16]
    [--precision bf16-mixed]

``FastLanguageModel.from_pretrained(DIR, load_in_4bit=True)`` (nf4, double quantization, bf16 compute: Unsloth's own
BitsAndBytesConfig) from a checkpoint written by ``save_pretrained`` or ``gpu_peers.write_random_checkpoint``;
``FastLanguageModel.get_peft_model`` with LoRA r (alpha 2r, dropout 0, no bias) on q, k, v, o, gate, up and down,
Unsloth's gradient checkpointing (``"unsloth"``); transformers' ``Trainer`` with AdamW (lr 1e-3, weight decay 0.01),
clipping at 1.0, a constant LR, bf16, seed 0, no shuffling. The batches are ``train_once.labelled_batches``'s:
byte tokens of the standard library's sources in non-overlapping windows of ``--seq``, labels = input ids.

The checkpoint needs no tokenizer: Unsloth loads one, so a word-level one of the config's vocabulary size (every id a
token, pad distinct from eos) is written to a temporary directory and passed as ``tokenizer_name``. Nothing is
downloaded: the Hugging Face offline switches and ``UNSLOTH_DISABLE_STATISTICS`` are set before Unsloth is imported.

Memory as in ``train_once.py``: ``max_memory_allocated`` minus the memory allocated at a baseline taken after every
import, before loading; ``after_load`` (quantized base and adapters, before the first step) and ``load_peak`` above
the same baseline. ``import unsloth`` comes before torch, transformers, peft and trl (it patches them). Without a
GPU it stops at that import (``UNSLOTH_DISABLE_CPU_FALLBACK=1``, else Unsloth would go on with its CPU backend).
Needs transformers <= 5.17 (Unsloth 2026.10.9's pin): run it on a ``PYTHONPATH`` without a newer one.
"""

from __future__ import annotations

import argparse
import json
import os
import sysconfig
import tempfile
from pathlib import Path
from typing import Any

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
OFFLINE = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "HF_HUB_DISABLE_TELEMETRY": "1",
    "UNSLOTH_DISABLE_STATISTICS": "1",  # else from_pretrained downloads a README from the hub as a usage counter
    "UNSLOTH_DISABLE_CPU_FALLBACK": "1",  # no GPU: fail at `import unsloth` instead of training on the CPU backend
}


def stdlib_bytes(max_bytes: int) -> bytes:
    """``pl_lowprec.demo.stdlib_text.stdlib_bytes``, copied: importing ``pl_lowprec`` would import transformers and
    lightning before Unsloth patches them."""
    root = Path(sysconfig.get_paths()["stdlib"])
    chunks, total = [], 0
    for path in sorted(root.glob("*.py")):
        data = path.read_bytes()
        chunks.append(data)
        total += len(data)
        if total >= max_bytes:
            break
    return b"".join(chunks)[:max_bytes]


def labelled_rows(args: argparse.Namespace) -> list[dict[str, Any]]:
    """``train_once.labelled_batches``: ``stdlib_text.windows`` of ``--seq`` bytes, the first steps x batch rows."""
    import torch

    tokens = torch.frombuffer(bytearray(stdlib_bytes(400_000)), dtype=torch.uint8).long()
    n = tokens.numel() // args.seq
    rows = tokens[: n * args.seq].view(n, args.seq)[: args.steps * args.batch]
    if len(rows) < args.steps * args.batch:
        raise SystemExit(f"unsloth_once: {len(rows)} windows of {args.seq} bytes, {args.steps * args.batch} needed")
    return [{"input_ids": r, "labels": r} for r in rows]


def write_tokenizer(pretrained: str, directory: Path) -> str:
    """A word-level tokenizer with exactly the checkpoint's ``vocab_size`` tokens, saved to ``directory``: Unsloth
    loads one with the model, and the checkpoint has none. Every id is a token, so no id of the data is out of
    range and Unsloth finds nothing to resize; pad is distinct from eos, so it adds no pad token either."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import AutoConfig, PreTrainedTokenizerFast

    config = AutoConfig.from_pretrained(pretrained, local_files_only=True)
    vocab_size = config.vocab_size
    if vocab_size < 259:
        raise SystemExit(f"unsloth_once: vocab_size {vocab_size} < 259 (256 byte tokens and bos, eos, pad)")

    def in_vocab(token_id: Any, fallback: int) -> int:
        token_id = token_id[0] if isinstance(token_id, list) else token_id
        return token_id if isinstance(token_id, int) and 0 <= token_id < vocab_size else fallback

    bos = in_vocab(config.bos_token_id, vocab_size - 3)
    eos = in_vocab(config.eos_token_id, vocab_size - 2)
    pad = next(i for i in range(vocab_size - 1, -1, -1) if i not in (bos, eos))
    names = {bos: "<bos>", eos: "<eos>", pad: "<pad>"}
    vocab = {names.get(i, f"<t{i}>"): i for i in range(vocab_size)}
    model = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    model.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=model, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>", unk_token="<pad>"
    )
    tokenizer.save_pretrained(directory)
    return str(directory)


def check_qlora(model: Any, linear4bit: type, dtype: Any) -> None:
    """Unsloth falls back to 16-bit LoRA, saying so in one printed line, where it finds bitsandbytes' native library
    unusable (and to float16 where it thinks bfloat16 unsupported): that would not be the QLoRA being compared."""
    layers = [m for m in model.modules() if isinstance(m, linear4bit)]
    if not layers:
        raise SystemExit("unsloth_once: Unsloth loaded no 4-bit layer (bitsandbytes unusable here?): not QLoRA")
    state = layers[0].weight.quant_state
    settings = (getattr(state, "quant_type", None), getattr(state, "nested", None), getattr(state, "dtype", None))
    if settings != ("nf4", True, dtype) or layers[0].compute_dtype not in (dtype, None):
        raise SystemExit(
            f"unsloth_once: 4-bit layers are (quant type, double quant, dtype) = {settings}, compute dtype"
            f" {layers[0].compute_dtype}; expected nf4, True, {dtype}"
        )
    lora = sum(p.numel() for n, p in model.named_parameters() if p.requires_grad and "lora_" in n)
    if lora == 0:
        raise SystemExit("unsloth_once: no trainable LoRA parameter")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pretrained", required=True, help="a save_pretrained directory (config.json, safetensors)")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--lora-r", type=int, default=16, help="LoRA rank; alpha is twice it")
    parser.add_argument("--precision", choices=["bf16-mixed"], default="bf16-mixed")
    args = parser.parse_args()
    if not (Path(args.pretrained) / "config.json").is_file():
        parser.error(f"--pretrained {args.pretrained}: no config.json there")

    for key, value in OFFLINE.items():
        os.environ.setdefault(key, value)
    root = tempfile.TemporaryDirectory(prefix="unsloth_once_")
    # Unsloth writes generated modules to ./unsloth_compiled_cache unless told otherwise: keep the checkout clean.
    os.environ.setdefault("UNSLOTH_COMPILE_LOCATION", str(Path(root.name) / "unsloth_compiled_cache"))

    import unsloth  # first: it patches transformers, peft and trl as they are imported
    from unsloth import FastLanguageModel

    # isort: split
    import bitsandbytes as bnb
    import torch
    from hf_trainer import train  # imports transformers when it runs: after Unsloth

    if not torch.cuda.is_available():  # UNSLOTH_ALLOW_CPU=1 (Unsloth's CUDA-shaped test mode) gets this far
        raise SystemExit(f"unsloth_once: Unsloth {unsloth.__version__} imported, but torch sees no CUDA GPU")
    dev = torch.device("cuda")
    data = labelled_rows(args)
    tokenizer_dir = write_tokenizer(args.pretrained, Path(root.name) / "tokenizer")

    torch.cuda.synchronize()
    start = torch.cuda.memory_allocated(dev)
    torch.cuda.reset_peak_memory_stats(dev)
    model, _tokenizer = FastLanguageModel.from_pretrained(
        model_name=args.pretrained,
        tokenizer_name=tokenizer_dir,
        max_seq_length=args.seq,
        dtype=torch.bfloat16,
        load_in_4bit=True,
        use_exact_model_name=True,  # a local directory: no mapping to a hub repo
        local_files_only=True,
        fix_tokenizer=False,
        use_gradient_checkpointing="unsloth",
        offload_embedding=False,  # the embedding stays on the GPU, as on the hf stack
    )
    model = FastLanguageModel.get_peft_model(
        model,
        r=args.lora_r,
        lora_alpha=2 * args.lora_r,
        lora_dropout=0.0,
        bias="none",
        target_modules=TARGETS,
        use_gradient_checkpointing="unsloth",
        random_state=0,  # LoRA initialisation, as torch.manual_seed(0) on the hf stack
        temporary_location=str(Path(root.name) / "buffers"),
    )
    check_qlora(model, bnb.nn.Linear4bit, torch.bfloat16)
    torch.cuda.synchronize()
    loaded = {
        "after_load": torch.cuda.memory_allocated(dev) - start,
        "load_peak": torch.cuda.max_memory_allocated(dev) - start,
    }
    times, losses = train(
        model, data, batch=args.batch, steps=args.steps, precision="bf16-mixed", output_dir=str(Path(root.name) / "out")
    )
    result = {"times": times, "losses": losses, "measured_peak": torch.cuda.max_memory_allocated(dev) - start}
    root.cleanup()
    print("RESULT " + json.dumps(result | loaded | {"unsloth": unsloth.__version__}), flush=True)


if __name__ == "__main__":
    main()
