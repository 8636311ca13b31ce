"""The strategy's own ``ModelTransform``, run on a meta-device model: only the steps that need real weights differ.

Loading ``pretrained=`` is skipped (shapes only: a directory with just ``config.json`` is enough), and
bitsandbytes layers become their stand-ins (``bnb_standin.py``), built through ``quantize_model``'s own layer
walk, and ``compile=`` builds the blocks as it does but compiles nothing (the estimate is the eager step of the
compiled run's blocks), so the estimate cannot drift from what the
strategy does: the same layers are quantized, the same LoRA targets adapted, the same blocks checkpointed, in
the same order. float8 runs emulated (fake CPU tensors).
Under FSDP (``sharding``) the 4-bit weights are torchao NF4 as in the real run, quantized from fake tensors in the
step's ``fake_mode``, and ``fully_shard`` runs on a fake process group (``fake_distributed.py``).
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from pl_lowprec.distributed.sharding import Sharding
from pl_lowprec.memory.bnb_standin import fake_quantized_layer
from pl_lowprec.transforms.config import TransformConfig
from pl_lowprec.transforms.pipeline import ModelTransform
from pl_lowprec.transforms.quantization import quantize_model


class SimulatedTransform(ModelTransform):
    """``ModelTransform`` for the fake step (see the module docstring)."""

    def __init__(
        self, config: TransformConfig, sharding: Sharding | None = None, fake_mode: FakeTensorMode | None = None
    ) -> None:
        self.fake_mode = fake_mode
        if config.fp8 is not None:  # fake CPU tensors: torchao's emulated float8 saves and casts the same tensors
            config = dataclasses.replace(config, fp8=dataclasses.replace(config.fp8, emulate=True))
        super().__init__(config, sharding)

    def check_compiler(self, device: torch.device) -> None:
        """An estimate needs no compiler: nothing is compiled."""

    def compile(self, model: nn.Module, units: object) -> None:
        """Nothing is compiled on fake tensors: the step runs the blocks eagerly, built as the compiled run builds
        them (without the fused MLP and row-wise norms that ``compile=`` leaves to inductor), and the module's
        compiled loss as its stand-in where it has one (``simulate_compiled_loss``, as ``CausalLM`` does)."""
        simulate = getattr(model, "simulate_compiled_loss", None)
        if callable(simulate):
            simulate()

    def load_pretrained(self, model: nn.Module, compute_dtype: torch.dtype, device: torch.device) -> None:
        """Nothing to load: the step needs shapes and dtypes, which the meta-device module has."""

    def load_adapter(self, model: nn.Module) -> int:
        """Nothing to load: ``pretrained_adapter=``'s config gave the LoRA its shapes, which are all the step needs."""
        return 0

    def quantize(self, model: nn.Module, compute_dtype: torch.dtype, device: torch.device) -> list[str]:
        if self.sharding is not None:  # torchao NF4 quantizes fake tensors, in the mode the step then runs in
            with self.fake_mode:
                for name, module in model.named_modules():
                    if name and self.config.quantization.wants(module, name):
                        empty = torch.empty(module.weight.shape, dtype=module.weight.dtype, device="cpu")
                        module.weight = nn.Parameter(empty, requires_grad=False)
                return self.sharding.quantize_model(model, self.config.quantization, torch.device("cpu"))
        return quantize_model(model, self.config.quantization, compute_dtype, device, fake_quantized_layer)
