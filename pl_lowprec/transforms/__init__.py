"""What happens to a model, one file per transform: quantization (bitsandbytes), NF4 (torchao, for sharding),
LoRA (peft), quantization-aware training, float8 training, activation checkpointing and offloading, optimizer
swaps; ``pipeline.ModelTransform`` orders them for every strategy and for the memory estimate."""
