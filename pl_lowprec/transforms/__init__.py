"""What happens to a model, one file per transform: quantization (bitsandbytes), NF4 (torchao, for sharding),
LoRA (peft), quantization-aware training, float8 training, activation checkpointing and offloading, optimizer
swaps. ``config.TransformConfig`` holds the model arguments; ``pipeline.ModelTransform`` orders the transforms
for every strategy, and the memory estimate runs the same ones."""
