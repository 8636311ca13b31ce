"""Validation perplexity after a fixed number of steps, per precision and fine-tuning mode (reported only).

Run: python benchmarks/run_all.py --only quality   (or python benchmarks/quality.py [--steps 40])
TinyLlama (hidden 128, 2 layers, randomly initialised base), Python's standard-library source as text,
batch 8 x 64 bytes, 8 validation batches. With a random base, adapters alone learn far less than a full
fine-tune; on a pretrained base they do not. Nothing here is asserted.
"""

from __future__ import annotations

import argparse
from typing import Any

import torch
from common import markdown_table, quiet_trainer, section, write_json

from pl_lowprec import AMPPrecision, LowPrecisionStrategy
from pl_lowprec.demo import StdlibTextDataModule, TinyLlama

LORA = {"r": 8, "lora_alpha": 16}
SETUPS: dict[str, tuple[str, dict[str, Any]]] = {
    "full, fp32": ("32-true", {}),
    "full, bf16-mixed": ("bf16-mixed", {}),
    "full, fp16-mixed (loss scaling)": ("16-mixed", {}),
    "LoRA r=8, fp32": ("32-true", {"lora": LORA}),
    "QLoRA nf4-dq + LoRA r=8, fp32 compute": ("32-true", {"quantization": "nf4-dq", "lora": LORA}),
}


def perplexity(precision: str, strategy: dict[str, Any], steps: int) -> float:
    torch.manual_seed(0)
    plugins = [AMPPrecision(precision)] if precision.endswith("-mixed") else []
    trainer = quiet_trainer(
        max_steps=steps,
        limit_val_batches=8,
        plugins=plugins,
        precision=None if plugins else precision,
        strategy=LowPrecisionStrategy(**strategy),
    )
    model = TinyLlama(hidden_size=128)
    data = StdlibTextDataModule(seq_len=64, batch_size=8)
    trainer.fit(model, data)
    return float(trainer.validate(model, data, verbose=False)[0]["val/perplexity"])


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    args = parser.parse_args(argv)
    result = {name: perplexity(precision, strategy, args.steps) for name, (precision, strategy) in SETUPS.items()}
    section(
        f"Quality: validation perplexity after {args.steps} steps (TinyLlama hidden 128, random base, "
        "stdlib text, batch 8 x 64; reported only)"
    )
    print(markdown_table(["setup", "val perplexity"], [(n, f"{v:.1f}") for n, v in result.items()]))
    write_json("quality", {"perplexity": result, "args": vars(args)})
    return result


if __name__ == "__main__":
    main()
