"""compile=: the predicted peak of compiled, checkpointed QLoRA blocks (the eager step of the blocks as compiled,
plus what inductor's backward holds, ``compiled_backward.py``) against the profiler's measured peak on CPU."""

import pytest
import torch
from compiled_peak_helpers import measure_compiled

from pl_lowprec.memory.compiled_backward import COMPILED_BACKWARD_BUFFERS, batch_tokens

HIDDEN, SEQ = 512, 1024  # Llama-3.2-1B's block proportions (MLP 4x wider, head_dim 64), a quarter as wide

SETUP = r"""
hidden, seq = int(sys.argv[1]), int(sys.argv[2])
directory = pretrained(hidden, 1024, hidden // 256)
strategy = LowPrecisionStrategy(quantization="nf4-dq", lora={"r": 16, "lora_alpha": 32},
    activation_checkpointing="LlamaDecoderLayer", compile=True)
batch = {"input_ids": torch.randint(0, 1024, (1, seq)), "labels": torch.randint(0, 1024, (1, seq))}
build = lambda: CausalLM(directory, loss_chunk_size=256)
estimate = estimate_memory(build, batch, precision="bf16-mixed", config=strategy.transform_config)
estimates = {"predicted": estimate.peak, "split": estimate.peak_split}
"""


def test_batch_tokens_reads_input_ids():
    ids = torch.zeros(2, 7, dtype=torch.long)
    assert batch_tokens({"input_ids": ids}) == 14 and batch_tokens(ids) == 14
    assert batch_tokens({"inputs_embeds": torch.zeros(2, 7, 4)}) == 0 and batch_tokens(torch.zeros(3)) == 0


@pytest.mark.slow
def test_compiled_checkpointed_blocks_peak_is_predicted_within_5_percent():
    result = measure_compiled(SETUP, str(HIDDEN), str(SEQ))
    measured, predicted = result["measured"], result["predicted"]
    extra = result["split"]["compiled backward buffers"]
    assert extra == int(COMPILED_BACKWARD_BUFFERS * SEQ * 4 * HIDDEN * 2)  # tokens x the MLP's width, bf16
    assert abs(predicted / measured - 1) < 0.05, (predicted, measured)
    assert (predicted - extra) / measured < 0.75, "the eager step alone would predict far less"
