"""The 57M-parameter Llama whose loading memory is measured: by ``load_memory.py`` (tests/loading/test_load_memory.py)
and by ``benchmarks/bin_load_memory.py``, so both load the same model.

Plain values only, no imports: importing ``load_memory.py`` itself from the benchmark would import transformers
before pl_lowprec, and transformers then prints torchao's warnings that ``import pl_lowprec`` silences
(``pl_lowprec._imports``: its CUDA-only kernels failing to load on a CPU machine).
"""

LOAD_MEMORY_LLAMA = {  # LlamaConfig(**LOAD_MEMORY_LLAMA): 227 MB of fp32 weights
    "vocab_size": 256,
    "hidden_size": 768,
    "intermediate_size": 2048,
    "num_hidden_layers": 8,
    "num_attention_heads": 12,
    "num_key_value_heads": 12,
    "max_position_embeddings": 64,
    "tie_word_embeddings": False,
}
