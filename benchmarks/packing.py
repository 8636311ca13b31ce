"""Padded against packed batches on variable-length prompt/completion data: target tokens per second, padding, memory.

Run: python benchmarks/run_all.py --only packing (about 100 s on a 2-core CPU)
Data: prompt/completion records cut from the standard library's sources (nothing downloaded), total lengths drawn
log-normal (median 200 tokens, sigma 0.8, clipped to 24-1000), 25-60% of each sample prompt. A 4-layer Llama
(hidden 256, MLP 768, 4 heads, vocab 1024) with seeded random weights, saved with ``save_pretrained``, trained in
full in fp32 through ``CausalLM.loss_sum`` on the batches of ``TextDataModule``, one epoch each, plain AdamW on
the token-mean loss. Padded: batches of ``PADDED_BATCH`` samples padded to their longest. Packed:
``packing=True``, ``PACKED_BATCH`` rows of 1024 tokens. Both see the same training samples (the same target
tokens) in the same number of optimizer steps; a third run, padded in another order, shows the noise of the loss.
Steps of the three alternate in rotating order on one torch thread, so load from other jobs on the machine hits
all alike. The peer, where TRL is installed (``pip install -c constraints.txt -e ".[bench]"``): TRL's
``SFTTrainer`` with ``SFTConfig(packing=True, packing_strategy="bfd")`` (which turns padding-free on: each batch
flattened into one row with restarting ``position_ids``, the same block-causal mask in eager/SDPA attention),
``completion_only_loss=True``, the same model, data, rows of 1024, 2 rows a step, AdamW (lr 1e-3, weight decay
0.01, constant) for one epoch, fp32, one thread; it runs its own loop, so it runs after the three, not
interleaved with them, and its step time is taken between ``on_step_begin`` and ``on_step_end`` (its activation
memory is not counted). Throughput is target tokens over the summed step time; activation memory is the largest
number of bytes saved for backward by one step, counted by ``count_saved_tensors`` (what ``MemoryTracker``
reports).
"""

from __future__ import annotations

import json
import math
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from common import markdown_table, section, write_json

from pl_lowprec.memory.activations import count_saved_tensors

SEQ_LEN, SAMPLES, HELD_OUT, PADDED_BATCH, PACKED_BATCH, LR = 1024, 160, 24, 8, 2, 1e-3
NAMES = ("padded", "packed", "padded, seed 1")  # the third: the same padded run in another order, for the noise
THREADS = 1
MEDIAN, SIGMA, SHORTEST, LONGEST = 200, 0.8, 24, 1000
HIDDEN, LAYERS, VOCAB = 256, 4, 1024


def write_model(directory: Path) -> Path:
    """A tokenizer trained on stdlib text and a 4-layer Llama of its vocabulary, as from the hub."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from pl_lowprec.demo.stdlib_text import stdlib_bytes
    from pl_lowprec.demo.tokenizer import train_tokenizer

    tokenizer = train_tokenizer([stdlib_bytes(400_000).decode("utf-8", "replace")], VOCAB)
    tokenizer.save_pretrained(directory)
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=HIDDEN,
        intermediate_size=3 * HIDDEN,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=SEQ_LEN,
    )
    LlamaForCausalLM(config).save_pretrained(directory)
    return directory


def write_records(path: Path, tokenizer_dir: Path, count: int, seed: int) -> list[int]:
    """Prompt/completion records of log-normal total length, cut from one tokenized stream of stdlib text."""
    from transformers import AutoTokenizer

    from pl_lowprec.demo.stdlib_text import stdlib_bytes

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    stream = tokenizer(stdlib_bytes(3_000_000).decode("utf-8", "replace"), add_special_tokens=False)["input_ids"]
    draw = random.Random(seed)
    lengths, records, at = [], [], draw.randrange(len(stream))
    for _ in range(count):
        n = min(LONGEST, max(SHORTEST, round(draw.lognormvariate(math.log(MEDIAN), SIGMA))))
        cut = round(n * draw.uniform(0.25, 0.6))
        if at + n > len(stream):
            at = 0
        prompt, completion = stream[at : at + cut], stream[at + cut : at + n]
        at += n
        records.append({"prompt": tokenizer.decode(prompt), "completion": tokenizer.decode(completion)})
        lengths.append(n)
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return lengths


class Contender:
    """One of the two runs: a ``TextDataModule``'s training batches, and ``CausalLM`` with its own AdamW."""

    def __init__(self, pretrained: Path, data_file: Path, packing: bool, seed: int) -> None:
        from transformers import LlamaForCausalLM

        from pl_lowprec.data import TextDataModule
        from pl_lowprec.models import CausalLM

        data = TextDataModule(
            str(data_file),
            str(pretrained),
            seq_len=SEQ_LEN,
            batch_size=PACKED_BATCH if packing else PADDED_BATCH,
            val_fraction=0,
            seed=seed,
            packing=packing,
            max_truncated_fraction=1.0,
        )
        data.setup("fit")
        self.batches = list(data.train_dataloader())
        lengths = data.train_set.row_lengths() if packing else [len(s["input_ids"]) for s in data.train_set]
        self.padding = 1 - sum(lengths) / sum(b["input_ids"].numel() for b in self.batches)
        self.model = CausalLM(str(pretrained))
        self.model.model = LlamaForCausalLM.from_pretrained(pretrained, dtype=torch.float32)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=LR)
        self.seconds: list[float] = []
        self.losses: list[float] = []
        self.targets = 0
        self.activation_bytes = 0

    def step(self, batch: dict[str, torch.Tensor]) -> None:
        """One optimizer step on the batch's token-mean loss; time, loss and the bytes saved for backward."""
        start = time.perf_counter()
        with count_saved_tensors(self.model) as saved:
            loss_sum, tokens = self.model.loss_sum(batch)
        (loss_sum / tokens).backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.seconds.append(time.perf_counter() - start)
        self.losses.append(float(loss_sum.detach() / tokens))
        self.targets += int(tokens)
        self.activation_bytes = max(self.activation_bytes, saved.nbytes)

    def held_out_loss(self, batches: list[dict[str, torch.Tensor]]) -> float:
        with torch.no_grad():
            sums = [self.model.loss_sum(b) for b in batches]
        return float(sum(s for s, _ in sums) / sum(t for _, t in sums))


def main(argv: list[str] | None = None) -> dict[str, Any]:
    from pl_lowprec.data import TextDataModule

    threads = torch.get_num_threads()
    torch.set_num_threads(THREADS)  # one thread: a busy second core slows both runs alike, not one OpenMP barrier
    try:
        return _compare(TextDataModule)
    finally:
        torch.set_num_threads(threads)


def _compare(TextDataModule: type) -> dict[str, Any]:

    with tempfile.TemporaryDirectory() as tmp:
        pretrained = write_model(Path(tmp) / "model")
        lengths = write_records(Path(tmp) / "train.jsonl", pretrained, SAMPLES, seed=0)
        write_records(Path(tmp) / "held_out.jsonl", pretrained, HELD_OUT, seed=1)
        held_out = TextDataModule(str(Path(tmp) / "held_out.jsonl"), str(pretrained), seq_len=SEQ_LEN, val_fraction=0)
        held_out.setup("fit")
        held_out_batches = [held_out._collate()(held_out.train_set[i : i + 8]) for i in range(0, HELD_OUT, 8)]
        data = Path(tmp) / "train.jsonl"
        runs = {name: Contender(pretrained, data, name == "packed", seed=int(name.endswith("1"))) for name in NAMES}
        torch.manual_seed(0)
        for i in range(max(len(r.batches) for r in runs.values())):  # rotating order: load drift hits all alike
            for name in NAMES[i % 3 :] + NAMES[: i % 3]:
                if i < len(runs[name].batches):
                    runs[name].step(runs[name].batches[i])
        result = {}
        for name, r in runs.items():
            result[name] = {
                "optimizer_steps": len(r.seconds),
                "target_tokens": r.targets,
                "padding_fraction": r.padding,
                "seconds": sum(r.seconds),
                "target_tokens_per_s": r.targets / sum(r.seconds),
                "activation_bytes": r.activation_bytes,
                "step_seconds": r.seconds,
                "loss_per_step": r.losses,
                "held_out_loss": r.held_out_loss(held_out_batches),
            }
        peer = trl_peer(pretrained, data, Path(tmp) / "trl", held_out_batches)
        if peer is not None:
            result[TRL_NAME] = peer
    speedup = result["packed"]["target_tokens_per_s"] / result["padded"]["target_tokens_per_s"]
    table = [
        (
            name,
            r["optimizer_steps"],
            r["target_tokens"],
            f"{r['padding_fraction']:.1%}",
            f"{r['seconds']:.1f}",
            f"{r['target_tokens_per_s']:.0f}",
            f"{r['activation_bytes'] / 2**20:.0f}" if r["activation_bytes"] else "not counted",
            " / ".join(f"{q:.2f}" for q in _quarters(r["loss_per_step"])),
            f"{r['held_out_loss']:.3f}",
        )
        for name, r in result.items()
    ]
    section(
        f"Packing: {SAMPLES} prompt/completion samples, log-normal lengths (median {MEDIAN}, sigma {SIGMA},"
        f" {SHORTEST}-{LONGEST} tokens; drawn median {statistics.median(lengths):.0f}, mean"
        f" {statistics.mean(lengths):.0f}, max {max(lengths)}); 4-layer Llama hidden {HIDDEN} through CausalLM, fp32;"
        f" padded {PADDED_BATCH} samples a batch, packed {PACKED_BATCH} rows of {SEQ_LEN}; {THREADS} torch thread,"
        " steps alternating"
    )
    headers = ["run", "optimizer steps", "target tokens", "padding", "train s", "target tokens/s"]
    headers += ["peak activation MiB", "train loss by quarter", f"held-out loss ({HELD_OUT} samples)"]
    print(markdown_table(headers, table))
    print(f"\nPacked / padded target tokens per second: {speedup:.2f}x")
    if TRL_NAME in result:
        ratio = result["packed"]["target_tokens_per_s"] / result[TRL_NAME]["target_tokens_per_s"]
        print(f"pl_lowprec packed / TRL packed target tokens per second: {ratio:.2f}x (TRL not interleaved)")
    result["speedup"] = speedup
    write_json("packing", result)
    return result


TRL_NAME = "TRL SFTTrainer(packing=True, bfd)"


def trl_peer(
    pretrained: Path, data_file: Path, out: Path, held_out_batches: list[dict[str, torch.Tensor]]
) -> dict[str, Any] | None:
    """TRL's packed SFT on the same data and model, one epoch; ``None`` (said) where TRL is not installed."""
    try:
        import datasets
        import trl
    except ImportError:
        print('TRL peer skipped: pip install -c constraints.txt -e ".[bench]" to run it.')
        return None
    from transformers import AutoTokenizer, LlamaForCausalLM, TrainerCallback

    from pl_lowprec.models import CausalLM

    class StepTimer(TrainerCallback):
        def __init__(self) -> None:
            self.seconds: list[float] = []
            self.started = 0.0

        def on_step_begin(self, args, state, control, **kwargs):
            self.started = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            self.seconds.append(time.perf_counter() - self.started)

    records = [json.loads(line) for line in data_file.read_text().splitlines()]
    model = LlamaForCausalLM.from_pretrained(pretrained, dtype=torch.float32)
    config = trl.SFTConfig(
        output_dir=str(out),
        packing=True,
        packing_strategy="bfd",
        max_length=SEQ_LEN,
        completion_only_loss=True,
        per_device_train_batch_size=PACKED_BATCH,
        num_train_epochs=1,
        learning_rate=LR,
        lr_scheduler_type="constant",
        weight_decay=0.01,
        optim="adamw_torch",
        use_cpu=True,
        bf16=False,
        fp16=False,
        dataloader_num_workers=0,
        save_strategy="no",
        logging_steps=1,
        report_to="none",
        seed=0,
        disable_tqdm=True,
    )
    timer = StepTimer()
    trainer = trl.SFTTrainer(
        model=model,
        args=config,
        train_dataset=datasets.Dataset.from_list(records),
        processing_class=AutoTokenizer.from_pretrained(pretrained),
        callbacks=[timer],
    )
    rows = trainer.train_dataset  # packed rows of up to SEQ_LEN tokens; the model shifts the labels
    targets = sum(int((batch["labels"][:, 1:] != -100).sum()) for batch in trainer.get_train_dataloader())
    tokens = sum(len(ids) for ids in rows["input_ids"])
    trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    held_out = CausalLM(str(pretrained))
    held_out.model = model.eval()
    with torch.no_grad():
        sums = [held_out.loss_sum(b) for b in held_out_batches]
    return {
        "optimizer_steps": len(timer.seconds),
        "target_tokens": int(targets),
        "padding_fraction": 1 - tokens / (len(rows) * SEQ_LEN),
        "seconds": sum(timer.seconds),
        "target_tokens_per_s": targets / sum(timer.seconds),
        "activation_bytes": 0,
        "step_seconds": timer.seconds,
        "loss_per_step": losses,
        "held_out_loss": float(sum(s for s, _ in sums) / sum(t for _, t in sums)),
    }


def _quarters(losses: list[float]) -> list[float]:
    """Mean per-step loss over each quarter of the run."""
    size = math.ceil(len(losses) / 4)
    return [statistics.mean(losses[i : i + size]) for i in range(0, len(losses), size)]


if __name__ == "__main__":
    main()
