"""What the fused LoRA MLP, the fp32-copy-free cross-entropy and the norms' row-wise backward change in a step.

Run: python benchmarks/fused_ops.py [--rounds 2] [--steps 5]

A random bf16 Llama saved as a Hugging Face directory (hidden 512, MLP 1536, 4 layers, vocab 32000) through the
shipped ``CausalLM`` path: nf4-dq, LoRA r=16 on every linear layer, every block checkpointed, loss in chunks of
256, bf16-mixed, batch 2 x 512. Two contenders, each in a fresh process per round, in rotating order:

- shipped: ``transforms/fused_lora_mlp.py``, ``models/cross_entropy.py``, norms' backward a few rows at a time;
- unfused: peft's LoRA layers and autograd for the MLP, ``F.cross_entropy`` on fp32 logits, norms' backward whole.

For each: the profiler's peak of step 2 (``memory/profiled.py``), the estimator's predicted peak, and the median
step time of the steps after it. The loss of step 1 is printed too: the contenders compute the same one.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

MiB = 2**20
CONTENDERS = ("shipped", "unfused")
SETTINGS = {
    "quantization": "nf4-dq",
    "lora": {"r": 16, "lora_alpha": 32, "lora_dropout": 0.0, "target_modules": "all-linear"},
    "activation_checkpointing": ["LlamaDecoderLayer"],
}


def save_model(directory: Path) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=32000,
        hidden_size=512,
        intermediate_size=1536,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=8,
        max_position_embeddings=512,
        tie_word_embeddings=False,
    )
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(directory)


def unfuse() -> None:
    """The paths before: no fused MLP, ``F.cross_entropy`` on fp32 logits, each norm's backward whole."""
    import torch.nn.functional as F

    import pl_lowprec.models.chunked_loss as chunked_loss
    import pl_lowprec.transforms.autocast_activations as autocast_activations
    import pl_lowprec.transforms.pipeline as pipeline
    from pl_lowprec.models.token_loss import IGNORE_INDEX

    pipeline.fuse_lora_mlps = lambda model: 0
    autocast_activations.ROW_ELEMENTS = 1 << 62
    chunked_loss.cross_entropy_sum = lambda logits, targets: F.cross_entropy(
        logits.float(), targets, ignore_index=IGNORE_INDEX, reduction="sum"
    )


def run_one(contender: str, directory: str, steps: int) -> dict:
    """Measured peak, predicted peak, step times and first loss of one contender, in this process."""
    warnings.filterwarnings("ignore")
    import torch
    from peak_memory import untracked_phases

    from pl_lowprec import estimate_memory
    from pl_lowprec.memory.estimate import _Precision
    from pl_lowprec.memory.fake_step import DryRunTrainer, attached, run_step
    from pl_lowprec.memory.profiled import measured_peak
    from pl_lowprec.models import CausalLM
    from pl_lowprec.transforms.config import TransformConfig
    from pl_lowprec.transforms.pipeline import ModelTransform

    if contender == "unfused":
        unfuse()
    torch.manual_seed(0)
    ids = torch.randint(0, 32000, (2, 512))
    batch = {"input_ids": ids, "labels": ids}
    module = CausalLM(directory, loss_chunk_size=256)
    transform = ModelTransform(TransformConfig(**SETTINGS))
    trainer = DryRunTrainer(transform, 1)
    with attached(module, trainer):
        module.configure_model()  # on the meta device: the transform streams the weights in
        transform.apply(module, _Precision("bf16-mixed"), torch.device("cpu"))
    optimizer = torch.optim.AdamW([p for p in module.parameters() if p.requires_grad], lr=1e-4)
    losses: list[float] = []

    def step() -> None:
        run_step(module, batch, optimizer, untracked_phases(), torch.bfloat16)

    with attached(module, trainer):
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            losses.append(float(module.training_step(batch, 0)))
        measured = measured_peak(step, before=step)  # step 1 makes the state and the gradients step 2 frees
        times = []
        for _ in range(steps):
            started = time.perf_counter()
            step()
            times.append(time.perf_counter() - started)
    predicted = estimate_memory(
        lambda: CausalLM(directory, loss_chunk_size=256), batch, precision="bf16-mixed", **SETTINGS
    ).peak
    return {"measured": measured, "predicted": predicted, "step_s": statistics.median(times), "loss": losses[0]}


def main(argv: list[str] | None = None) -> dict:
    from common import describe_machine, machine_info, markdown_table, section, write_json

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--one", nargs=2, metavar=("CONTENDER", "DIR"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.one:
        print(json.dumps(run_one(args.one[0], args.one[1], args.steps)))
        return {}
    print(describe_machine(machine_info()))
    runs: dict[str, list[dict]] = {name: [] for name in CONTENDERS}
    with tempfile.TemporaryDirectory() as tmp:
        save_model(Path(tmp))
        for index in range(args.rounds):
            order = CONTENDERS if index % 2 == 0 else CONTENDERS[::-1]
            for name in order:
                command = [sys.executable, __file__, "--one", name, tmp, "--steps", str(args.steps)]
                out = subprocess.run(command, capture_output=True, text=True, check=True).stdout
                runs[name].append(json.loads(out.strip().splitlines()[-1]))
    section("Llama hidden 512, MLP 1536, 4 layers, vocab 32000; QLoRA nf4-dq r=16, blocks checkpointed, bf16-mixed")
    rows = []
    for name, results in runs.items():
        first = results[0]
        step_s = statistics.median(r["step_s"] for r in results)
        rows.append([name, first["measured"] / MiB, first["predicted"] / MiB, step_s, first["loss"]])
    print(markdown_table(["", "measured peak MiB", "predicted MiB", "step s (median)", "loss of step 1"], rows))
    shipped, unfused = (statistics.median(r["step_s"] for r in runs[n]) for n in CONTENDERS)
    print(f"\nshipped / unfused: peak {rows[0][1] / rows[1][1]:.3f}x, step time {shipped / unfused:.3f}x")
    write_json("fused_ops", {"runs": runs})
    return {"runs": runs}


if __name__ == "__main__":
    main()
