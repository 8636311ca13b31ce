"""compile=: the predicted peak of compiled, checkpointed QLoRA blocks (the eager step of the blocks as compiled,
plus what inductor's backward holds, ``compiled_backward.py``) against the profiler's measured peak on CPU."""

import json
import subprocess
import sys

import pytest
import torch

from pl_lowprec.memory.compiled_backward import COMPILED_BACKWARD_BUFFERS, batch_tokens

HIDDEN, SEQ = 512, 1024  # Llama-3.2-1B's block proportions (MLP 4x wider, head_dim 64), a quarter as wide

# A fresh process: the profiler's peak counts every live storage at the start of the step, other tests' included.
MEASURE = r"""
import json, sys, tempfile, warnings
warnings.filterwarnings("ignore")
import lightning.pytorch as pl
import torch
from transformers import LlamaConfig, LlamaForCausalLM
from pl_lowprec import AMPPrecision, LowPrecisionStrategy
from pl_lowprec.memory.estimate import estimate_memory
from pl_lowprec.memory.profiled import measured_peak
from pl_lowprec.models import CausalLM

hidden, seq = int(sys.argv[1]), int(sys.argv[2])
torch.manual_seed(0)
config = LlamaConfig(hidden_size=hidden, intermediate_size=4 * hidden, num_attention_heads=hidden // 64,
    num_key_value_heads=hidden // 256, head_dim=64, num_hidden_layers=2, vocab_size=1024, tie_word_embeddings=True)
directory = tempfile.mkdtemp()
LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(directory)
strategy = LowPrecisionStrategy(quantization="nf4-dq", lora={"r": 16, "lora_alpha": 32},
    activation_checkpointing="LlamaDecoderLayer", compile=True)
batch = {"input_ids": torch.randint(0, 1024, (1, seq)), "labels": torch.randint(0, 1024, (1, seq))}
build = lambda: CausalLM(directory, loss_chunk_size=256)
estimate = estimate_memory(build, batch, precision="bf16-mixed", config=strategy.transform_config)
model = build()
trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=2, logger=False, enable_checkpointing=False,
    enable_progress_bar=False, enable_model_summary=False, strategy=strategy, plugins=[AMPPrecision("bf16-mixed")])
trainer.fit(model, torch.utils.data.DataLoader([batch] * 2, batch_size=None))

def step():
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss, _ = model.loss_sum(batch)
    loss.backward()
    for p in model.parameters():
        p.grad = None

step()
print("RESULT " + json.dumps({"measured": measured_peak(step), "predicted": estimate.peak,
    "split": estimate.peak_split}))
"""


def test_batch_tokens_reads_input_ids():
    ids = torch.zeros(2, 7, dtype=torch.long)
    assert batch_tokens({"input_ids": ids}) == 14 and batch_tokens(ids) == 14
    assert batch_tokens({"inputs_embeds": torch.zeros(2, 7, 4)}) == 0 and batch_tokens(torch.zeros(3)) == 0


@pytest.mark.slow
def test_compiled_checkpointed_blocks_peak_is_predicted_within_5_percent():
    done = subprocess.run(
        [sys.executable, "-c", MEASURE, str(HIDDEN), str(SEQ)], capture_output=True, text=True, timeout=300
    )
    line = next((x for x in done.stdout.splitlines() if x.startswith("RESULT ")), None)
    assert line is not None, done.stderr[-3000:]
    result = json.loads(line.removeprefix("RESULT "))
    measured, predicted = result["measured"], result["predicted"]
    extra = result["split"]["compiled backward buffers"]
    assert extra == int(COMPILED_BACKWARD_BUFFERS * SEQ * 4 * HIDDEN * 2)  # tokens x the MLP's width, bf16
    assert abs(predicted / measured - 1) < 0.05, (predicted, measured)
    assert (predicted - extra) / measured < 0.75, "the eager step alone would predict far less"
