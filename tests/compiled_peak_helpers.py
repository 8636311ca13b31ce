"""The measured peak of a compiled QLoRA step on CPU, in a fresh process (the profiler's peak counts every live
storage at the start of the step, other tests' included), beside the estimates the caller's script makes.

``measure_compiled(setup)``: ``setup`` is Python that defines ``strategy`` (a ``LowPrecisionStrategy`` with
``compile=True``), ``build`` (the module, a fresh one per call), ``batch`` and ``estimates`` (a dict of predicted
peaks); the helper fits two steps with them, then profiles two more in Lightning's gradient order (the second is
measured) and returns ``estimates`` with ``"measured"`` added.
"""

import json
import subprocess
import sys

PRELUDE = r"""
import json, sys, tempfile, warnings
warnings.filterwarnings("ignore")
import lightning.pytorch as pl
import torch
from transformers import LlamaConfig, LlamaForCausalLM
from pl_lowprec import AMPPrecision, LowPrecisionStrategy
from pl_lowprec.memory.estimate import estimate_memory
from pl_lowprec.memory.profiled import measured_peak
from pl_lowprec.models import CausalLM
from pl_lowprec.transforms.config import TransformConfig

def pretrained(hidden, vocab, kv_heads):
    # Llama-3.2-1B's block proportions (MLP 4x wider, head_dim 64), two blocks, tied embeddings
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=hidden, intermediate_size=4 * hidden, num_attention_heads=hidden // 64,
        num_key_value_heads=kv_heads, head_dim=64, num_hidden_layers=2, vocab_size=vocab, tie_word_embeddings=True)
    directory = tempfile.mkdtemp()
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(directory)
    return directory
"""

EPILOGUE = r"""
model = build()
trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=2, logger=False, enable_checkpointing=False,
    enable_progress_bar=False, enable_model_summary=False, strategy=strategy, plugins=[AMPPrecision("bf16-mixed")])
trainer.fit(model, torch.utils.data.DataLoader([batch] * 2, batch_size=None))

def step():  # Lightning's order: the last step's gradients live through the forward, freed before the backward
    # the fit's own autocast (no cast cache): its compiled graphs serve it (torch.autocast's default cache failed
    # their guards and compiled every block again, seconds)
    with trainer.precision_plugin.forward_context():
        loss, _ = model.loss_sum(batch)
    for p in model.parameters():
        p.grad = None
    loss.backward()

for p in model.parameters():
    p.grad = None
step()  # anything still to compile does so outside the profiler
for p in model.parameters():
    p.grad = None
# `before` makes, under the profiler, the gradients the measured step holds through its forward and frees
print("RESULT " + json.dumps({**estimates, "measured": measured_peak(step, before=step)}))
"""


def measure_compiled(setup: str, *args: str) -> dict:
    done = subprocess.run(
        [sys.executable, "-c", PRELUDE + setup + EPILOGUE, *args], capture_output=True, text=True, timeout=300
    )
    line = next((x for x in done.stdout.splitlines() if x.startswith("RESULT ")), None)
    assert line is not None, done.stderr[-3000:]
    return json.loads(line.removeprefix("RESULT "))
