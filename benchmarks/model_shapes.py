"""Real models' config.json (hyperparameters only), embedded so the GPU benchmark needs nothing outside the
repository: the device machine gets the checkout alone. Llama-3.2-1B's is here; the others the tests embed too,
and are read from there (tests/model_shapes.py, loaded by path: both modules are named model_shapes)."""

import importlib.util
from pathlib import Path

_spec = importlib.util.spec_from_file_location(
    "tests_model_shapes", Path(__file__).resolve().parents[1] / "tests" / "model_shapes.py"
)
_tests = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_tests)

# Llama-3.2-1B (meta-llama/Llama-3.2-1B): tied embeddings, GQA 32/8, llama3 rope scaling
LLAMA_3_2_1B = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 2048,
    "intermediate_size": 8192,
    "num_hidden_layers": 16,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 64,
    "vocab_size": 128256,
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-05,
    "rope_theta": 500000.0,
    "tie_word_embeddings": True,
    "rope_scaling": {
        "factor": 32.0,
        "high_freq_factor": 4.0,
        "low_freq_factor": 1.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    },
    "bos_token_id": 128000,
    "eos_token_id": 128001,
    "torch_dtype": "bfloat16",
    "attention_bias": False,
    "attention_dropout": 0.0,
    "hidden_act": "silu",
    "initializer_range": 0.02,
    "mlp_bias": False,
    "pretraining_tp": 1,
    "use_cache": True,
}

SHAPES = {
    "1b": LLAMA_3_2_1B,
    "8b": _tests.LLAMA31_8B,  # untied head, vocab 128,256
    "qwen-0.5b": _tests.QWEN25_05B,  # qkv biases, 14/2 heads, MLP 4864, tied, vocab 151,936; held out from the fits
    "mistral-7b": _tests.MISTRAL_7B_V03,  # Llama-3.1-8B's blocks, vocab 32,768; held out from the fits
    "smollm2-135m": _tests.SMOLLM2_135M,  # tied, 9/3 heads, hidden 576, vocab 49,152: the CPU user's path
}

# The CPU check of the GPU benchmark's code path: 2 small blocks.
TINY = SHAPES["1b"] | {"num_hidden_layers": 2, "hidden_size": 256, "intermediate_size": 512, "vocab_size": 4096}
TINY |= {"num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 32}
# Llama-3.2-1B's 16 blocks and every op of its step at widths too small to compute much: on a CPU its step time is
# the host's (Python, the dispatcher, autograd, Lightning's or Trainer's loop), which a GPU step waits on when the
# GPU is faster than the host can launch.
HOST = SHAPES["1b"] | {"hidden_size": 64, "intermediate_size": 128, "vocab_size": 512, "head_dim": 16}
HOST |= {"num_attention_heads": 4, "num_key_value_heads": 2}
SMALL_SHAPES = {"tiny": TINY, "host": HOST}
