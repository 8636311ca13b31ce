"""Can the meta device time the host's share of a step? The same training step (a Llama of Hugging Face's with
peft LoRA r=8 on every linear layer, fp32, AdamW) on the CPU and on the meta device, at shapes small enough that
the CPU step is nearly all host time (Python, dispatch, autograd). If the meta step took what the CPU step takes,
timing it at a model's real shapes, where nothing computes, would give the host term the step-time prediction
leaves out (docs/benchmarks.md, "Fit against a plain loop"). It does not: meta's kernels run Python shape
functions, which cost more than the CPU's kernels at these sizes.

Run: python benchmarks/host_on_meta.py [--steps 15]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from common import describe_machine, machine_info, markdown_table, write_json

WORKLOADS = [(64, 2, 1, 16), (128, 2, 8, 128), (64, 16, 1, 16), (256, 16, 2, 64)]  # hidden, layers, rows, seq


def build(hidden: int, layers: int, device: str) -> torch.nn.Module:
    import peft
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        hidden_size=hidden,
        intermediate_size=4 * hidden,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_hidden_layers=layers,
        vocab_size=512,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(config)
    return peft.get_peft_model(model, peft.LoraConfig(r=8, target_modules="all-linear"))


def step_seconds(model: torch.nn.Module, ids: torch.Tensor, steps: int) -> float:
    """The median wall time of a step (forward, backward, AdamW), from the fourth step on."""
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    times = []
    for _ in range(steps):
        started = time.perf_counter()
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - started)
    return statistics.median(times[3:])


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=15)
    args = parser.parse_args(argv)
    info = machine_info()
    print(describe_machine(info))
    rows, table = [], []
    for hidden, layers, batch, seq in WORKLOADS:
        seconds = {}
        for device in ("cpu", "meta"):
            ids = torch.randint(0, 512, (batch, seq), device=device)
            seconds[device] = step_seconds(build(hidden, layers, device), ids, args.steps)
        rows.append({"hidden": hidden, "layers": layers, "batch": [batch, seq], **seconds})
        label = f"{hidden}, {layers}, {batch} x {seq}"
        table.append([label, seconds["cpu"] * 1e3, seconds["meta"] * 1e3, seconds["meta"] / seconds["cpu"]])
    print(markdown_table(["hidden, layers, batch", "CPU step ms", "meta step ms", "meta / CPU"], table))
    write_json("host_on_meta", {"machine": info, "steps": args.steps, "results": rows})
    return rows


if __name__ == "__main__":
    main()
