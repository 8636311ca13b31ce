"""A GGUF export read back with transformers against the merged export it came from: greedy completions of the
held-out prompts that agree, and the largest logit difference on them.

    pl-lowprec export --ckpt_path CKPT --out runs/merged --merged
    pl-lowprec export --ckpt_path CKPT --out runs/gguf_bf16 --format gguf
    pl-lowprec export --ckpt_path CKPT --out runs/gguf_q8_0 --format gguf --gguf_type q8_0
    python benchmarks/gguf_roundtrip.py runs/merged runs/gguf_bf16/model-bf16.gguf runs/gguf_q8_0/model-q8_0.gguf \
        --prompts runs/demo/data/val.jsonl

Each model computes in float32 and uses its own tokenizer (the GGUF's read back from the file); completions are
greedy, 16 new tokens.

With ``--llama_cpp DIR`` (a llama.cpp build's ``bin`` folder; not a dependency of the project), llama.cpp itself
reads each file too: ``llama-tokenize --ids`` against the merged tokenizer's ids, and ``llama-simple`` (greedy, up
to 16 new tokens, stopping at the end-of-generation token as ``generate`` does) against the merged model's
completions, each prompt in its own process.
"""

from __future__ import annotations

import argparse
import ast
import subprocess
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from pl_lowprec.export.generate import Decoding, Generator
from pl_lowprec.export.prompt_files import read_prompts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("merged", help="The --merged export directory.")
    parser.add_argument("gguf_files", nargs="+", help="GGUF files exported from the same checkpoint.")
    parser.add_argument("--prompts", required=True, help=".jsonl or .txt prompts (plain prompts).")
    parser.add_argument("--llama_cpp", type=Path, help="llama.cpp's build/bin: also run llama.cpp on each file.")
    args = parser.parse_args()
    prompts = [r["prompt"] for r in read_prompts(Path(args.prompts)) if "prompt" in r]
    decoding = Decoding(max_new_tokens=16)
    merged = AutoModelForCausalLM.from_pretrained(args.merged, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(args.merged)
    expected = Generator(merged, tokenizer).complete(prompts, decoding)
    for gguf_file in map(Path, args.gguf_files):
        model = AutoModelForCausalLM.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name, dtype=torch.float32)
        from_gguf = AutoTokenizer.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name)
        same_ids = sum(from_gguf(p)["input_ids"] == tokenizer(p)["input_ids"] for p in prompts)
        got = Generator(model, from_gguf).complete(prompts, decoding)
        agree = sum(a == b for a, b in zip(got, expected, strict=True))
        difference = 0.0
        with torch.no_grad():
            for prompt in prompts:
                ids = torch.tensor([tokenizer(prompt)["input_ids"]])
                difference = max(difference, (model(input_ids=ids).logits - merged(input_ids=ids).logits).abs().max())
        print(
            f"{gguf_file}: {gguf_file.stat().st_size:,} bytes; token ids equal on {same_ids}/{len(prompts)} prompts;"
            f" greedy completions equal on {agree}/{len(prompts)}; max |logit difference| {float(difference):.2e}"
        )
        if args.llama_cpp:
            ids = sum(llama_cpp_ids(args.llama_cpp, gguf_file, p) == tokenizer(p)["input_ids"] for p in prompts)
            completions = [llama_cpp_completion(args.llama_cpp, gguf_file, p, tokenizer) for p in prompts]
            equal = sum(a == b for a, b in zip(completions, expected, strict=True))
            print(
                f"{gguf_file} in llama.cpp: token ids equal on {ids}/{len(prompts)} prompts; greedy completions equal"
                f" on {equal}/{len(prompts)}"
            )


def llama_cpp_ids(binaries: Path, gguf_file: Path, prompt: str) -> list[int]:
    command = [str(binaries / "llama-tokenize"), "-m", str(gguf_file), "-p", prompt, "--ids", "--log-disable"]
    done = subprocess.run(command, capture_output=True, text=True, check=True)
    return ast.literal_eval(done.stdout.strip().splitlines()[-1])


def llama_cpp_completion(binaries: Path, gguf_file: Path, prompt: str, tokenizer) -> str:
    """llama-simple's greedy completion: it prints the prompt's tokens (the BOS as its text) then the new ones."""
    command = [str(binaries / "llama-simple"), "-m", str(gguf_file), "-n", "16", prompt]
    done = subprocess.run(command, capture_output=True, check=True)
    text = done.stdout.decode("utf-8", errors="replace")
    shown = (tokenizer.bos_token or "") + prompt
    if not text.startswith(shown):
        raise RuntimeError(f"llama-simple printed {text[:80]!r}, which does not start with the prompt {shown!r}")
    return text[len(shown) :].removesuffix("\n")


if __name__ == "__main__":
    main()
