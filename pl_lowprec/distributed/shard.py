"""FSDP2 data-parallel sharding of a transformed model: which blocks form a shard unit, and the one place that
shards them.

``Sharding`` is what ``ModelTransform`` holds under ``strategy="lowprec_fsdp"``: it stores 4-bit base weights as
torchao NF4 (``pl_lowprec.transforms.nf4``), the only storage that keeps its constants through ``fully_shard``,
and, as the last step of the transform, shards each unit bottom-up and then the LightningModule itself as the root
(torchtune's ``shard_model``), whose step methods run as the root's forward (``shard_root``). The units are
chosen like activation checkpointing's blocks (classes, class names or a predicate), and a name that matches
nothing lists the model's classes.

Memory from the start: a module built on the meta device never exists whole on a rank. As each of its tensors
is loaded (``pretrained=``) or initialized (its module's ``reset_parameters``), and quantized if it is to be, the
rank keeps only its own rows, as a DTensor ``local_rows`` (torchtune's ``load_from_full_model_state_dict``:
quantize the full weight, then take the chunk, so the constants equal those of a weight sharded whole). LoRA,
k-bit preparation and checkpointing then run on these placeholders; ``shard`` hands FSDP2 meta stand-ins of the
same shapes and puts the rows back, which FSDP2 adopts at its lazy init (``reset_sharded_param``). A rank holds
1/N of the model plus the one tensor being loaded.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import nn

from pl_lowprec._imports import import_torchao_nf4
from pl_lowprec.loading.empty import assert_no_meta
from pl_lowprec.transforms.checkpointing import CheckpointPolicy, select_modules
from pl_lowprec.transforms.nf4 import (
    NF4Layout,
    check_layout,
    check_mode,
    describe_choice,
    nf4_linear,
    quantize_model_nf4,
)
from pl_lowprec.transforms.quantization import QuantizationConfig, will_quantize

ShardPolicy = CheckpointPolicy


def data_parallel_mesh(device_type: str, world_size: int) -> Any:
    """A 1-D mesh over every rank (FSDP only, no tensor parallelism), on CPU as on CUDA.

    Its dimension is named ``"fsdp"``: peft sizes LoRA layers by the local shard of a DTensor weight on a mesh
    with any other name (tensor parallelism), and by the full layer on an ``"fsdp"`` mesh."""
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(device_type, (world_size,), mesh_dim_names=("fsdp",))


def is_sharded(model: nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return any(isinstance(m, FSDPModule) for m in model.modules())


def full_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor gathered into one full tensor on every rank (a collective); any other tensor as it is."""
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def local_rows(tensor: torch.Tensor, mesh: Any) -> torch.Tensor:
    """This rank's rows of a full tensor (``torch.chunk`` along dim 0, as FSDP2 splits it), in their own storage,
    as a DTensor of the full shape. An NF4 tensor is chunked with its block scales and factors."""
    from torch.distributed.tensor import DTensor, Shard

    world, rank = mesh.size(), mesh.get_local_rank()
    chunks = torch.chunk(tensor, world, dim=0)
    rows = chunks[rank] if rank < len(chunks) else tensor[:0]
    own = tensor.new_zeros(rows.shape)  # a copy: a view would keep the full tensor's storage alive
    own.copy_(rows)
    return DTensor.from_local(own, mesh, [Shard(0)], run_check=False, shape=tensor.shape, stride=tensor.stride())


def is_local_rows(tensor: torch.Tensor) -> bool:
    return hasattr(tensor, "placements")


def shard_units(model: nn.Module, policy: ShardPolicy | None) -> list[tuple[str, nn.Module]]:
    """The blocks that each become one FSDP unit; ``ValueError`` listing the model's classes if none is named."""
    if policy is None:
        classes = sorted({type(m).__name__ for m in model.modules()})
        raise ValueError(
            f"strategy='lowprec_fsdp' needs to know which blocks of {type(model).__name__} to shard: pass"
            " shard_modules= (or activation_checkpointing=, whose blocks are then the shard units), e.g. the"
            f" decoder layer class. The model contains these classes: {', '.join(classes)}."
        )
    return select_modules(model, policy, argument="shard_modules")


STEP_METHODS = ("training_step", "validation_step", "test_step", "predict_step")


def step_methods(model: nn.Module) -> list[str]:
    """The step methods a LightningModule defines itself: each runs as the FSDP root's forward."""
    import lightning.pytorch as pl
    from lightning.pytorch.utilities.model_helpers import is_overridden

    if not isinstance(model, pl.LightningModule):
        return []
    return [name for name in STEP_METHODS if is_overridden(name, model, pl.LightningModule)]


def shard_root(model: nn.Module, **options: Any) -> list[str]:
    """``fully_shard`` the LightningModule itself as the root, and run each of its step methods as the root's
    forward (FSDP2's ``register_fsdp_forward_method``); return those methods' names.

    Whatever a step calls then sees gathered parameters: the model's own forward, or a submodule and a head
    called one by one (``CausalLM``'s chunked loss calls the base model and then the output embedding), or a
    parameter the module holds itself. This is what Lightning does for DDP and FSDP1, whose wrapper's forward
    runs the step. The root keeps FSDP2's own choice for a root: gathered from the step until its backward."""
    from torch.distributed.fsdp import fully_shard, register_fsdp_forward_method

    fully_shard(model, **{**options, "reshard_after_forward": None})
    methods = step_methods(model)
    for name in methods:
        register_fsdp_forward_method(model, name)
    return methods


def shard_pretrained_blocks(module: nn.Module, network: nn.Module, mesh: Any) -> list[str]:
    """FSDP2 for a LightningModule holding a Hugging Face model, under Lightning's own ``ModelParallelStrategy``
    (whose ``configure_model`` must shard): each block the model names in ``_no_split_modules`` (its decoder
    layer) is a unit, then the module itself is the root (``shard_root``); returns the unit names."""
    from torch.distributed.fsdp import fully_shard

    dims = tuple(mesh.mesh_dim_names or ())
    if "tensor_parallel" in dims and mesh["tensor_parallel"].size() > 1:
        raise ValueError(
            f"{type(module).__name__} shards data-parallel only, and ModelParallelStrategy has tensor_parallel_size="
            f"{mesh['tensor_parallel'].size()} (its 'auto' puts every device of a node in tensor parallelism). Pass"
            " ModelParallelStrategy(data_parallel_size=<devices>, tensor_parallel_size=1), or strategy='lowprec_fsdp'."
        )
    data_parallel = mesh["data_parallel"] if "data_parallel" in dims else mesh
    names = set(getattr(network, "_no_split_modules", None) or ())
    blocks = [(name, m) for name, m in network.named_modules() if type(m).__name__ in names]
    if not blocks:
        raise ValueError(
            f"{type(network).__name__} names no blocks to shard (_no_split_modules={sorted(names)}): use"
            " strategy='lowprec_fsdp' with shard_modules=[...]."
        )
    for _, block in blocks:
        fully_shard(block, mesh=data_parallel)
    shard_root(module, mesh=data_parallel)
    return [name for name, _ in blocks]


SUPPORTED_PRECISIONS = (
    "AMPPrecision('bf16-mixed' | '16-mixed' | 'auto')",
    "Trainer(precision='32-true')",
    "Trainer(precision='bf16-true')",
    "Trainer(precision='bf16-mixed')",
)


def check_precision(plugin: Any) -> None:
    """Refuse a precision plugin that cannot run under FSDP2 here, naming the ones that can."""
    from lightning.pytorch.plugins.precision import HalfPrecision, MixedPrecision, Precision

    from pl_lowprec.plugins.amp import AMPPrecision

    kind = type(plugin)
    fits = (
        isinstance(plugin, AMPPrecision)
        or kind is Precision
        or (kind is HalfPrecision and plugin.precision == "bf16-true")
        or (kind is MixedPrecision and plugin.precision == "bf16-mixed")
    )
    if not fits:
        name = f"{kind.__name__}({str(getattr(plugin, 'precision', ''))!r})"
        raise ValueError(
            f"strategy='lowprec_fsdp' cannot run {name}. It runs: {', '.join(SUPPORTED_PRECISIONS)}. fp16 needs"
            " AMPPrecision('16-mixed'), whose loss scaler agrees on overflows across the shards; pure fp16 weights"
            " ('16-true') have no scaler, and 64-bit or other precision plugins do not shard here."
        )


def check_trainable_dtypes(model: nn.Module) -> None:
    """FSDP2 reduce-scatters a unit's gradients in one buffer: every trainable parameter needs one dtype."""
    by_dtype: dict[torch.dtype, list[str]] = {}
    for name, param in model.named_parameters():
        if param.requires_grad:
            by_dtype.setdefault(param.dtype, []).append(name)
    if len(by_dtype) > 1:
        shown = "; ".join(f"{dtype}: {', '.join(names[:3])}" for dtype, names in by_dtype.items())
        raise ValueError(
            f"Trainable parameters in {len(by_dtype)} dtypes ({shown}): FSDP2 reduces each unit's gradients in one"
            " buffer. Keep them in one dtype (with a mixed precision, pl_lowprec upcasts the LoRA adapters to fp32)."
        )


@dataclass
class Sharding:
    """How ``ModelTransform`` stores and shards the model under FSDP2; ``mesh`` is set by the strategy once the
    processes exist.

    Args:
        units: Blocks that each form a shard unit: module classes, class names or ``(module, name) -> bool``.
        reshard_after_forward: Free each unit's gathered weights after its forward (less memory, one more
            all-gather in backward).
        cpu_offload: Keep sharded parameters, gradients and optimizer state in CPU memory (CUDA only).
        layout: How NF4 weights are blocked (see ``pl_lowprec.transforms.nf4.NF4Layout``).
    """

    units: ShardPolicy | None = None
    reshard_after_forward: bool = True
    cpu_offload: bool = False
    layout: NF4Layout = field(default_factory=NF4Layout)
    mesh: Any = None

    @property
    def world_size(self) -> int:
        if self.mesh is None:
            raise RuntimeError("The device mesh is built when the processes start (strategy.setup_environment).")
        return self.mesh.size()

    def check_quantization(self, config: QuantizationConfig) -> None:
        """When the strategy is built: a mode that shards, and torchao installed."""
        check_mode(config)
        import_torchao_nf4()

    def check(self, model: nn.Module, config: QuantizationConfig | None) -> None:
        """Everything that can be wrong with the model, before any weight is loaded or quantized."""
        if is_sharded(model):
            return
        shard_units(model, self.units)
        if config is not None:
            scaler_sizes = check_layout(model, config, self.layout, self.world_size)
            if self.layout.is_auto and scaler_sizes:
                rank_zero_info(describe_choice(scaler_sizes, self.world_size))

    def quantize_model(self, model: nn.Module, config: QuantizationConfig, device: torch.device) -> list[str]:
        return quantize_model_nf4(model, config, self.layout, device, self.world_size)

    def quantize_layer(
        self, linear: nn.Linear, config: QuantizationConfig, compute_dtype: torch.dtype, device: torch.device
    ) -> nn.Module:
        """One layer, as ``pretrained=`` streams it in (the signature of ``quantization.quantize_linear``)."""
        return nf4_linear(linear, self.layout, device, self.world_size)

    def placement(self) -> Callable[[nn.Parameter], nn.Parameter] | None:
        """What a rank keeps of each parameter as a meta module is filled: its rows (``local_rows``) when there
        are several ranks; the whole tensor on one process, where nothing is sharded."""
        if self.world_size == 1:
            return None

        def keep_local_rows(param: nn.Parameter) -> nn.Parameter:
            return nn.Parameter(local_rows(param.detach(), self.mesh), requires_grad=param.requires_grad)

        return keep_local_rows

    def initialize(
        self,
        model: nn.Module,
        config: QuantizationConfig | None,
        compute_dtype: torch.dtype,
        device: torch.device,
        quantize_layer: Callable[..., nn.Module],
    ) -> list[str]:
        """Materialize a module built on the meta device without pretrained weights, one module at a time: its
        parameters made real at full size, set by its own ``reset_parameters()``, quantized if it is to be, and
        only this rank's rows kept. Returns the modules initialized."""
        owners = [name for name, m in model.named_modules() if any(p.is_meta for p in m.parameters(recurse=False))]
        _check_initializable(model, owners)
        place = self.placement()
        for name in owners:
            module = model.get_submodule(name)
            module.to_empty(device=device, recurse=False)
            with torch.no_grad():
                module.reset_parameters()
            if config is not None and will_quantize(module, name, config):
                parent, _, child = name.rpartition(".")
                module = quantize_layer(module, config, compute_dtype, device)
                setattr(model.get_submodule(parent) if parent else model, child, module)
            if place is not None:
                for attr, param in module.named_parameters(recurse=False):
                    module._parameters[attr] = place(param)
        assert_no_meta(model)
        return owners

    def shard(self, model: nn.Module) -> list[str]:
        """``fully_shard`` each unit, then the module itself as the root (idempotent); return the unit names."""
        from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy, fully_shard

        if is_sharded(model):
            return []
        check_trainable_dtypes(model)
        units = shard_units(model, self.units)
        if self.world_size == 1:
            return []  # one process: nothing to split, and NF4 has no FSDP2 path for a mesh of one
        options = {
            "mesh": self.mesh,
            "reshard_after_forward": self.reshard_after_forward,
            "offload_policy": CPUOffloadPolicy() if self.cpu_offload else OffloadPolicy(),
        }
        rows = _meta_stand_ins(model)
        for _, unit in units:
            fully_shard(unit, **options)
        if all(model is not unit for _, unit in units):
            shard_root(model, **options)
        for module, attr, param in rows:
            setattr(module, attr, param)  # FSDP2 adopts these rows as its shards at lazy init
        return [name for name, _ in units]


def _check_initializable(model: nn.Module, owners: list[str]) -> None:
    """Every module with meta parameters needs ``reset_parameters``, and no parameter may be shared (tied)."""
    modules = {name: model.get_submodule(name) for name in owners}
    lacking = [
        f"{n} ({type(m).__name__})" for n, m in modules.items() if not callable(getattr(m, "reset_parameters", None))
    ]
    seen: dict[int, str] = {}
    tied = []
    for name, param in model.named_parameters(remove_duplicate=False):
        if param.is_meta and id(param) in seen:
            tied.append(f"{seen[id(param)]} = {name}")
        seen.setdefault(id(param), name)
    if lacking or tied:
        why = f"these modules have no reset_parameters(): {', '.join(lacking[:6])}" if lacking else ""
        why += ("; " if why and tied else "") + (f"these parameters are tied: {', '.join(tied[:4])}" if tied else "")
        raise ValueError(
            f"{type(model).__name__} was built on the meta device without pretrained weights, so"
            " strategy='lowprec_fsdp' initializes each module with its own reset_parameters() as it shards it, but"
            f" {why}. Pass pretrained="
            " (a safetensors file or model directory), or build the module with real weights."
        )


def _meta_stand_ins(model: nn.Module) -> list[tuple[nn.Module, str, nn.Parameter]]:
    """Swap every ``local_rows`` parameter for a meta tensor of its full shape (``fully_shard`` splits those
    without memory); return the rows to put back once the modules are sharded."""
    rows, stand_ins = [], {}
    for module in model.modules():
        for attr, param in list(module._parameters.items()):
            if param is None or not is_local_rows(param):
                continue
            rows.append((module, attr, param))
            if id(param) not in stand_ins:  # a tied parameter stays one parameter for FSDP2
                stand_in = torch.empty(param.shape, dtype=param.dtype, device="meta")
                stand_ins[id(param)] = nn.Parameter(stand_in, requires_grad=param.requires_grad)
            module._parameters[attr] = stand_ins[id(param)]
    return rows
