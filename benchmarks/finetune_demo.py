"""Fine-tuning the demo model teaches the demo task: validation loss and matching held-out completions, before/after.

    pl-lowprec make-demo-model runs/demo            # once (about a minute on 2 cores)
    python benchmarks/finetune_demo.py runs/demo runs/finetune_demo [config overrides, e.g. --trainer.max_steps=40]

Runs ``configs/finetune-causal-lm.yaml`` as shipped (``precision: auto``, nf4-dq + LoRA r=8, 60 steps) on the demo
model and counts the 80 held-out prompts whose greedy completion's first line is the taught one.
"""

from pl_lowprec.demo.task_check import main

if __name__ == "__main__":
    main()
