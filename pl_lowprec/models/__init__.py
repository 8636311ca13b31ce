"""LightningModules for pretrained models."""

from pl_lowprec.models.causal_lm import CausalLM
from pl_lowprec.models.forward_batch import forward_batch

__all__ = ["CausalLM", "forward_batch"]
