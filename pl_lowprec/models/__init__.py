"""LightningModules for pretrained models."""

from pl_lowprec.models.causal_lm import CausalLM

__all__ = ["CausalLM"]
