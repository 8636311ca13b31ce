"""``compile=``: ``torch.compile`` each block of the model after the other transforms, and the loss.

As torchtune and torchtitan do, the unit of compilation is the repeated block (the decoder layer), each compiled
on its own with ``nn.Module.compile``: one small graph that every layer reuses, compiled once, instead of one graph
of the whole model. It runs last, after quantization, LoRA, checkpointing and, under FSDP2, ``fully_shard``
(torchtitan's order), so the compiled code includes the checkpoint and the adapters. The blocks are those that
``activation_checkpointing`` names, else the FSDP2 shard units, else the blocks a Hugging Face model declares in
``_no_split_modules`` (its decoder layer). A LightningModule that computes its loss outside those blocks may
define ``compile_loss(options)``; ``CausalLM`` compiles its chunked cross-entropy there.

What cannot compile is refused when the strategy is built, naming the combination and the reason; on CPU,
inductor writes C++ and needs a compiler, checked before the first step. What really compiled is logged once, after
the first optimizer step (``CompileClock``, from torch._dynamo's own records, ``compile_report.py``): graphs,
recompiles and their reasons, seconds, and a warning naming each graph break.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import nn
from torch._inductor import config as inductor_config
from torch._inductor import list_mode_options
from torch._inductor.cpp_builder import get_cpp_compiler
from torch._inductor.exc import InvalidCxxCompiler

from pl_lowprec._checks import CannotRunHere
from pl_lowprec.transforms.checkpointing import CheckpointPolicy, is_checkpointed, resolved_blocks, select_modules
from pl_lowprec.transforms.compile_report import CompileWatch

CompileArg = bool | Mapping[str, Any]
COMPILE_KEYS = tuple(name for name in inspect.signature(torch.compile).parameters if name != "model")


def compile_options(value: object) -> dict[str, Any] | None:
    """``compile=`` as ``torch.compile``'s keyword arguments (``{}`` for ``True``), ``None`` when off."""
    if value is False or value is None:
        return None
    if value is True:
        return {}
    if isinstance(value, Mapping) and all(isinstance(k, str) for k in value):
        unknown = sorted(set(value) - set(COMPILE_KEYS))
        if unknown:
            raise ValueError(
                f"compile={dict(value)!r} has arguments torch.compile does not take: {', '.join(unknown)}. It takes"
                f" {', '.join(COMPILE_KEYS)}; for example compile={{'mode': 'max-autotune-no-cudagraphs'}}, or"
                " compile={'dynamic': False}. Inductor settings go in compile={'options': {...}}."
            )
        check_mode(value)
        return dict(value)
    raise TypeError(
        f"compile={value!r} is not valid: use True (torch.compile each block with its defaults), False (default),"
        " or a dict of torch.compile arguments such as {'mode': 'max-autotune-no-cudagraphs'} or"
        f" {{'dynamic': False}} (it takes {', '.join(COMPILE_KEYS)})."
    )


def check_mode(options: Mapping[str, Any]) -> None:
    """inductor's modes are checked by torch.compile only when the first step compiles: check them here."""
    mode = options.get("mode")
    if mode is None or options.get("backend", "inductor") != "inductor":
        return
    modes = list(list_mode_options())
    if mode not in modes:
        raise ValueError(
            f"compile={{'mode': {mode!r}}} is not a mode of torch.compile's inductor backend. Allowed:"
            f" {', '.join(map(repr, modes))} (or leave mode out for 'default')."
        )


def check_compile_combination(
    options: Mapping[str, Any] | None, checkpoint_impl: str, quantization_mode: str | None
) -> None:
    """Refuse the model arguments that do not compile, naming the combination and why."""
    if options is None:
        return
    if quantization_mode == "int8":
        raise ValueError(
            "compile= with quantization='int8': bitsandbytes' Linear8bitLt updates its MatmulLtState inside forward,"
            " which torch.compile does not trace (a graph break in every layer, and under checkpointing the update"
            " is not replayed in recompute), and its gradients are not reproducible enough to check against eager."
            " Use quantization='nf4' or 'nf4-dq' (4-bit layers compile without graph breaks), or drop compile=."
        )
    if checkpoint_impl == "reentrant":
        raise ValueError(
            "compile= with checkpoint_impl='reentrant': reentrant checkpointing runs each block inside an"
            " autograd.Function that torch.compile cannot trace into, so every block breaks the graph and little is"
            " compiled. Use checkpoint_impl='non_reentrant' (the default), which compiles with the block."
        )


def check_compiler(device: torch.device, options: Mapping[str, Any]) -> None:
    """On CPU, inductor (the default backend) compiles C++: refuse before the first step if no compiler is found."""
    backend = options.get("backend") or "inductor"
    if device.type != "cpu" or backend != "inductor":
        return

    try:
        get_cpp_compiler()
    except InvalidCxxCompiler:
        raise CannotRunHere(
            "compile= on CPU: torch.compile's inductor backend writes C++ kernels and found no C++ compiler (it"
            f" looked for {inductor_config.cpp.cxx!r}). Install one: apt-get install g++ (Debian/Ubuntu), or conda"
            " install -c conda-forge gxx; or point the CXX environment variable at one before starting. Without a"
            " compiler, drop compile= (or pass compile={'backend': 'aot_eager'}, which checks tracing only)."
        ) from None


def compile_units(model: nn.Module, policy: CheckpointPolicy | None) -> list[tuple[str, nn.Module]]:
    """The blocks to compile: ``policy`` (checkpointed blocks or shard units), else (``None`` or ``"auto"``) the
    blocks the model declares; ``ValueError`` listing the model's classes if there are none."""
    policy = resolved_blocks(model, "auto" if policy is None else policy)
    if policy is None:
        classes = sorted({type(m).__name__ for m in model.modules()})
        raise ValueError(
            f"compile= compiles each repeated block of {type(model).__name__} on its own, and none is named: pass"
            " activation_checkpointing= (its blocks are then compiled too), or shard_modules= under lowprec_fsdp,"
            f" naming the decoder layer class. The model contains these classes: {', '.join(classes)}."
        )
    return select_modules(model, policy, argument="compile")


def compile_model(model: nn.Module, policy: CheckpointPolicy | None, options: Mapping[str, Any]) -> list[str]:
    """``block.compile(**options)`` for each block (idempotent) and the module's ``compile_loss``; return the
    names of the blocks compiled now."""
    compiled = []
    for name, block in compile_units(model, policy):
        if getattr(block, "_compiled_call_impl", None) is None:
            block.compile(**options)
            compiled.append(name)
        if is_checkpointed(block):
            block.forward.compiled = True
    compile_loss = getattr(model, "compile_loss", None)
    if compiled and callable(compile_loss):
        compile_loss(dict(options))
    return compiled


class CompileClock:
    """Reports what ``torch.compile`` really compiled: once after the first optimizer step (graphs, recompiles,
    seconds; a warning naming each graph break, since a break in a checkpointed block leaves it uncompiled), and
    at the end of training what compiled after that step (a new shape, validation's no-grad pass), if anything."""

    def __init__(self) -> None:
        self.watch: CompileWatch | None = None
        self.later: CompileWatch | None = None
        self.blocks = 0

    def started(self, blocks: int) -> None:
        if self.watch is None and self.later is None:
            self.watch, self.blocks = CompileWatch(), blocks

    def report_once(self) -> None:
        if self.watch is None:
            return
        activity, self.watch, self.later = self.watch.activity(), None, CompileWatch()
        rank_zero_info(activity.first_step_line(self.blocks))
        if activity.graph_breaks or activity.failures:
            rank_zero_warn(activity.broken_graphs_warning())

    def report_later(self) -> None:
        if self.later is None:
            return
        activity, self.later = self.later.activity(), None
        if activity.graphs or activity.graph_breaks or activity.failures:
            rank_zero_info(activity.later_line())
        if activity.graph_breaks or activity.failures:
            rank_zero_warn(activity.broken_graphs_warning())
