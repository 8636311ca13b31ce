"""Quantization-aware training against post-training quantization, side by side in one run.

Run: python benchmarks/qat_vs_ptq.py [--pretrain-steps 600] [--finetune-steps 300] [--group-size 32 | 0]
(``--group-size 0``: one scale per output channel, a coarser int4 grid than groups of 32).

The embedded task (the package's pretrained demo model does not exist yet): a TinyLlama (hidden 128, 2 layers,
byte-level) is first trained from scratch on Python's stdlib sources, standing in for a pretrained base. From
that same base, two fine-tunes of the same steps on the same batches, AdamW with a cosine decay to zero (as
torchtune's fine-tuning recipes; QAT needs the weights to settle on the grid by the end):

- without QAT (fp32), then quantized after training (PTQ) to int8 dynamic activations + int4 grouped weights;
- with ``LowPrecisionStrategy(qat="int8-dynamic-int4-weight")``, converted to the same format at the end of fit.

Reported: validation loss of the unquantized fine-tune, of the PTQ model and of the QAT model, and each quantized
model's gap to the unquantized one. Both quantized models use torchao's same post-training config and the same
layers (every linear layer but the output head), so the gaps differ only by how the weights were trained.
"""

from __future__ import annotations

import argparse
import warnings

import torch
from lightning.pytorch import Trainer

from pl_lowprec import LowPrecisionStrategy
from pl_lowprec.demo import StdlibTextDataModule, TinyLlama
from pl_lowprec.transforms.qat import QATConfig, is_converted


class FineTune(TinyLlama):
    """The demo model with the usual fine-tuning schedule: short warm-up, then cosine decay to zero."""

    def __init__(self, total_steps: int, **kwargs: object) -> None:
        super().__init__(**kwargs)
        self.total_steps = total_steps

    def configure_optimizers(self):
        opt = torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=self.lr)
        sched = torch.optim.lr_scheduler.OneCycleLR(
            opt, max_lr=self.lr, total_steps=self.total_steps, pct_start=0.05, anneal_strategy="cos"
        )
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def trainer(steps: int, strategy: LowPrecisionStrategy) -> Trainer:
    return Trainer(
        accelerator="cpu",
        max_steps=steps,
        strategy=strategy,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
    )


@torch.no_grad()
def validation_loss(model: TinyLlama, data: StdlibTextDataModule) -> float:
    model.eval()
    losses = [model.model(input_ids=b["input_ids"], labels=b["input_ids"]).loss for b in data.val_dataloader()]
    model.train()
    return torch.stack(losses).mean().item()


def post_training_quantize(model: TinyLlama, config: QATConfig) -> None:
    from torchao.quantization import quantize_

    quantize_(model, config.base_config(), filter_fn=lambda module, name: config.wants(module, name))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pretrain-steps", type=int, default=600)
    parser.add_argument("--finetune-steps", type=int, default=300)
    parser.add_argument("--group-size", type=int, default=32, help="weights per scale; 0: one per output channel")
    args = parser.parse_args()
    warnings.filterwarnings("ignore", message=r".*(val_dataloader|does not have many workers|LeafSpec).*")

    data = StdlibTextDataModule(seq_len=128, batch_size=16)
    data.setup("fit")
    torch.manual_seed(0)
    base = TinyLlama(lr=3e-3, warmup_steps=20)
    trainer(args.pretrain_steps, LowPrecisionStrategy()).fit(base, data)
    base_loss = validation_loss(base, data)

    config = QATConfig("int8-dynamic-int4-weight", group_size=args.group_size or None)
    plain, qat = (FineTune(args.finetune_steps, lr=1e-3) for _ in range(2))
    for model in (plain, qat):
        model.load_state_dict(base.state_dict())
    torch.manual_seed(1)
    trainer(args.finetune_steps, LowPrecisionStrategy()).fit(plain, data)
    torch.manual_seed(1)
    trainer(args.finetune_steps, LowPrecisionStrategy(qat=config)).fit(qat, data)
    assert is_converted(qat)

    unquantized = validation_loss(plain, data)
    post_training_quantize(plain, config)
    ptq = validation_loss(plain, data)
    qat_loss = validation_loss(qat, data)

    print(
        f"TinyLlama (hidden 128, 2 layers), base: {args.pretrain_steps} steps from scratch (val loss"
        f" {base_loss:.4f}); fine-tune: {args.finetune_steps} steps, batch 16 x 128 bytes, AdamW 1e-3 cosine"
        " to 0, fp32."
    )
    groups = f"groups of {args.group_size}" if args.group_size else "one scale per output channel"
    print(f"Target format: int8 dynamic per-token activations, int4 weights, {groups}.\n")
    print("| model | validation loss | gap to unquantized fine-tune |")
    print("|---|---|---|")
    print(f"| fine-tuned, unquantized (fp32) | {unquantized:.4f} | |")
    print(f"| fine-tuned, then quantized (PTQ) | {ptq:.4f} | {ptq - unquantized:+.4f} |")
    print(f"| fine-tuned with QAT, converted | {qat_loss:.4f} | {qat_loss - unquantized:+.4f} |")
    verdict = "smaller" if qat_loss - unquantized < ptq - unquantized else "NOT smaller"
    print(f"\nQAT's gap is {verdict} than PTQ's: {qat_loss - unquantized:+.4f} against {ptq - unquantized:+.4f}.")


if __name__ == "__main__":
    main()
