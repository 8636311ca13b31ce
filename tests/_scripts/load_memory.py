"""Peak resident memory of loading a Llama checkpoint, streamed and quantized, or loaded whole then quantized.

Usage: python load_memory.py {write|stream|full} DIR   (prints one JSON line; sizes in bytes)
- write: save a ~57M-parameter fp32 Llama to DIR (227 MB of safetensors).
- stream: build it under empty_weights() and load_pretrained(..., nf4-dq): what pretrained= does.
- full: from_pretrained(DIR) in fp32, then quantize_model(nf4-dq): what a module that loads its own weights does.
The peak is VmHWM reset after imports, the meta build and one small quantization (bitsandbytes' native
library takes ~50 MB the first time it runs, whatever the model), so it counts only what loading adds.
Run by tests/loading/test_load_memory.py with MALLOC_MMAP_THRESHOLD_=1048576: glibc otherwise serves
these 6 MB tensors from its heap and keeps the freed memory, where a real checkpoint's tensors (above glibc's
32 MB ceiling) are always mapped and returned on free.
"""

import json
import sys

import torch
from load_memory_llama import LOAD_MEMORY_LLAMA
from transformers import LlamaConfig, LlamaForCausalLM

from pl_lowprec.loading import empty_weights, load_pretrained
from pl_lowprec.memory.process import memory_stats, reset_peak
from pl_lowprec.transforms.quantization import QuantizationConfig, quantize_linear, quantize_model

CPU = torch.device("cpu")
CONFIG = LlamaConfig(**LOAD_MEMORY_LLAMA)  # the model benchmarks/bin_load_memory.py loads too


def tensor_bytes(model: torch.nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in model.state_dict().values() if torch.is_tensor(t))


def main(mode: str, directory: str) -> None:
    torch.set_num_threads(1)
    quantization = QuantizationConfig.from_mode("nf4-dq")
    if mode == "write":
        torch.manual_seed(0)
        LlamaForCausalLM(CONFIG).save_pretrained(directory)
        return
    with empty_weights():
        model = LlamaForCausalLM(CONFIG)
    fp32_bytes = sum(p.numel() * 4 for p in model.parameters())
    if mode == "full":
        del model
    quantize_linear(torch.nn.Linear(64, 64), quantization, torch.float32, CPU)  # warm up bitsandbytes
    reset_peak(CPU)
    before = memory_stats(CPU)["rss_current"]
    if mode == "stream":
        load_pretrained(model, directory, quantization=quantization)
    else:
        model = LlamaForCausalLM.from_pretrained(directory, dtype=torch.float32)
        quantize_model(model, quantization, torch.float32, CPU)
    stats = memory_stats(CPU)
    after = {
        "fp32_model_bytes": fp32_bytes,
        "final_model_bytes": tensor_bytes(model),
        "added_peak_bytes": stats["rss_peak"] - before,
        "added_final_bytes": stats["rss_current"] - before,
    }
    print(json.dumps(after))


if __name__ == "__main__":
    main(*sys.argv[1:3])
