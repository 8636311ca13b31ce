"""compile=: each block compiled after the transform and the loss too, gradients equal to eager, the compile
time logged once, and what cannot compile refused with a paragraph before any step."""

import json
import logging
import re

import pytest
import torch
from lightning.pytorch import seed_everything
from lightning_helpers import quiet_trainer
from loading_helpers import save_pretrained_dir
from qlora_helpers import GradRecorder, LossRecorder, tiny_llama

from pl_lowprec import AMPPrecision, LowPrecisionStrategy
from pl_lowprec.transforms import compiling
from pl_lowprec.transforms.compile_report import CompileWatch
from pl_lowprec.transforms.config import TransformConfig

# Inductor reorders fp32 reductions; over two steps of a tiny model the gradients agree to this tolerance.
RTOL, ATOL = 1e-4, 1e-5
# Each gradient's relative error (of its norm) under bf16-mixed: a few bf16 roundings in the first step (0.8% seen),
# then also the first Adam step's difference: B starts at zero and moves by lr x sign(grad), so the few elements
# whose tiny gradient changed sign move the other way (3.3% seen). A missing or wrong term is off by far more.
BF16_ERROR = (2e-2, 6e-2)
# On a GPU, Triton's kernels round at yet other points, so more of those signs flip: 7.2% seen in the second step on
# an H200 (torch 2.11), the first step within 2% as on the CPU.
BF16_ERROR_GPU = (2e-2, 1e-1)


@pytest.mark.parametrize("bad", ["yes", 1, ["mode"]])
def test_a_value_that_is_not_true_or_a_dict_is_refused(bad):
    with pytest.raises(TypeError, match=re.escape(f"compile={bad!r} is not valid: use True (torch.compile each")):
        TransformConfig(activation_checkpointing="Block", compile=bad)


def test_unknown_compile_arguments_are_refused_with_the_allowed_ones():
    with pytest.raises(ValueError, match=r"torch.compile does not take: fast, modes\. It takes fullgraph, dynamic,"):
        TransformConfig(compile={"modes": "max-autotune", "fast": True})
    assert TransformConfig(compile={"mode": "max-autotune-no-cudagraphs"}).compile_kwargs == {
        "mode": "max-autotune-no-cudagraphs"
    }
    assert TransformConfig(compile=True).compile_kwargs == {} and TransformConfig().compile_kwargs is None


def test_combinations_that_cannot_compile_are_refused():
    with pytest.raises(ValueError, match=r"compile= with quantization='int8': bitsandbytes' Linear8bitLt .*'nf4'"):
        LowPrecisionStrategy(quantization="int8", compile=True)
    with pytest.raises(ValueError, match=r"compile= with checkpoint_impl='reentrant'.*'non_reentrant'"):
        LowPrecisionStrategy(activation_checkpointing="Block", checkpoint_impl="reentrant", compile=True)


def test_no_cpp_compiler_is_refused_before_any_step_with_the_install_hint(monkeypatch):
    monkeypatch.setattr(compiling.inductor_config.cpp, "cxx", ("no-such-cxx",))
    model = tiny_llama(hidden_size=32, layers=1)
    strategy = LowPrecisionStrategy(activation_checkpointing="LlamaDecoderLayer", compile=True)
    trainer = quiet_trainer(strategy=strategy, max_steps=1)
    with pytest.raises(RuntimeError, match=r"found no C\+\+ compiler .*'no-such-cxx'.*apt-get install g\+\+"):
        trainer.fit(model, [{"input_ids": torch.zeros(2, 8, dtype=torch.long)}])
    assert trainer.global_step == 0 and model.model.model.layers[0]._compiled_call_impl is None


def test_a_model_without_named_blocks_is_refused_listing_its_classes():
    from pl_lowprec.demo import TinyGPT

    with pytest.raises(ValueError, match=r"compile= compiles each repeated block of TinyGPT.*Block, Embedding"):
        compiling.compile_units(TinyGPT(dim=32, layers=1, heads=2, max_len=16), None)
    llama = tiny_llama(hidden_size=32, layers=2)  # a Hugging Face model names its decoder layer itself
    assert [n for n, _ in compiling.compile_units(llama, None)] == ["model.model.layers.0", "model.model.layers.1"]
    # under lowprec_fsdp the shard units come from activation_checkpointing="auto" and reach compile as "auto"
    assert compiling.compile_units(llama, "auto") == compiling.compile_units(llama, None)


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory):
    pytest.importorskip("bitsandbytes")
    return save_pretrained_dir(tmp_path_factory.mktemp("pretrained"), hidden_size=32, layers=3)


def _fit(pretrained, tmp_path, precision="32-true", quantization="nf4", accelerator="cpu", **strategy):
    """Two optimizer steps of CausalLM QLoRA, every decoder layer checkpointed; the model, each step's gradients
    and losses, and what torch.compile did meanwhile."""
    from pl_lowprec.data import TextDataModule
    from pl_lowprec.models import CausalLM

    path = tmp_path / "pc.jsonl"
    rows = [{"prompt": f"def f{i}(x):\n    return", "completion": f" x + {i}"} for i in range(10, 18)]
    path.write_text("\n".join(json.dumps(r) for r in rows))
    data = TextDataModule(train_files=path, tokenizer=str(pretrained), batch_size=4, val_fraction=0, seed=0)
    seed_everything(0)
    model = CausalLM(str(pretrained), lr=1e-2, warmup_steps=1, loss_chunk_size=8)
    grads, losses = GradRecorder(), LossRecorder()
    base = {"quantization": quantization, "lora": {"r": 8}, "activation_checkpointing": ["LlamaDecoderLayer"]}
    trainer = quiet_trainer(
        accelerator=accelerator,
        strategy=LowPrecisionStrategy(**base, **strategy),
        **({"precision": precision} if precision == "32-true" else {"plugins": [AMPPrecision(precision)]}),
        max_steps=2,
        callbacks=[grads, losses],
    )
    if "compile" in strategy:
        torch._dynamo.reset()  # graphs another test compiled (for other precisions) are not this run's
    watch = CompileWatch()
    trainer.fit(model, datamodule=data)
    return model, grads.grads, losses.losses, watch.activity()


def test_compiled_qlora_blocks_and_loss_match_eager(pretrained, tmp_path, caplog):
    eager_model, eager, _, _ = _fit(pretrained, tmp_path)
    with caplog.at_level(logging.INFO, logger="lightning.pytorch.utilities.rank_zero"):
        model, compiled, _, _ = _fit(pretrained, tmp_path, compile=True)
    layer = model.model.model.layers[0]
    assert layer._compiled_call_impl is not None and type(layer.self_attn.q_proj.base_layer).__name__ == "Linear4bit"
    assert model.loss_fn is not eager_model.loss_fn  # the chunked loss is compiled too
    assert len(compiled) == len(eager) == 2 and any("lora_A" in n for n in compiled[1])
    for step_eager, step_compiled in zip(eager, compiled, strict=True):
        assert step_eager.keys() == step_compiled.keys()
        for name in step_eager:
            torch.testing.assert_close(step_compiled[name], step_eager[name], rtol=RTOL, atol=ATOL)
    reports = [r.getMessage() for r in caplog.records if r.getMessage().startswith("torch.compile: ")]
    assert len(reports) == 1 and "(3 blocks wrapped)" in reports[0] and "no graph breaks" in reports[0]


@pytest.mark.parametrize("accelerator", ["cpu", pytest.param("gpu", marks=pytest.mark.cuda)])
def test_bf16_qlora_blocks_compile_whole_one_graph_for_all_layers_and_train_as_eager(pretrained, tmp_path, accelerator):
    """The shipped recipe (nf4-dq, LoRA, every block checkpointed, bf16-mixed: the norms' and LoRA's autocast hooks)
    compiles each block whole, without graph breaks, and the layers share their graphs (a per-layer guard would
    recompile each one, and past dynamo's limit of 8 the rest would run eagerly); it trains as eager does. On a GPU:
    bitsandbytes' CUDA kernels and Triton's instead of C++."""
    recipe = {"precision": "bf16-mixed", "quantization": "nf4-dq", "accelerator": accelerator}
    _, eager, eager_losses, _ = _fit(pretrained, tmp_path, **recipe)
    model, compiled, losses, activity = _fit(pretrained, tmp_path, **recipe, compile=True)
    assert activity.graph_breaks == {} and activity.failures == []
    blocks = [f for f in activity.frames if f.function.startswith("__call__ (checkpointing.py")]
    # one graph for the first layer (its input needs no gradient: the embeddings are frozen), one for the others
    assert len(blocks) == 2, activity.frames
    assert "requires_grad mismatch" in blocks[1].recompile_reason  # "tensor 'args[0]' requires_grad mismatch ..."
    assert type(model.model.model.layers[2].mlp.down_proj.base_layer).__name__ == "Linear4bit"
    # inductor fuses the norms' and the loss's elementwise ops, rounding to bf16 at other points than eager
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(eager_losses), rtol=1e-2, atol=0)
    bounds = BF16_ERROR_GPU if accelerator == "gpu" else BF16_ERROR
    for step_eager, step_compiled, tolerance in zip(eager, compiled, bounds, strict=True):
        assert step_eager.keys() == step_compiled.keys() and len(step_eager) == 3 * 7 * 2
        errors = {name: _relative_error(step_compiled[name], step_eager[name]) for name in step_eager}
        assert max(errors.values()) < tolerance, sorted(errors.items(), key=lambda kv: -kv[1])[:3]


def _relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return float((actual.float() - expected.float()).norm() / expected.float().norm().clamp(min=1e-12))


def test_selective_checkpointing_compiles_to_eager_gradients_and_counts_at_run_time():
    from pl_lowprec import set_activation_checkpointing
    from pl_lowprec.memory.activations import count_saved_tensors
    from pl_lowprec.transforms.lora import inject_lora, lora_config

    def build():
        torch.manual_seed(0)
        model = tiny_llama(hidden_size=32, layers=2)
        inject_lora(model, lora_config({"r": 4}), ("lm_head",))
        set_activation_checkpointing(model, "LlamaDecoderLayer", mode="selective")
        return model

    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))

    def step(model):
        model.zero_grad()
        with count_saved_tensors(model) as counter:
            loss = model.model(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        return counter.nbytes, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    eager, compiled = build(), build()
    assert compiling.compile_model(compiled, "LlamaDecoderLayer", {}) == [
        "model.model.layers.0",
        "model.model.layers.1",
    ]
    _, expected = step(eager)
    traced_bytes, actual = step(compiled)  # the first call traces: nothing is counted while tracing
    run_bytes, _ = step(compiled)
    assert traced_bytes == run_bytes
    for name in expected:
        torch.testing.assert_close(actual[name], expected[name], rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("torch_tags", [True, False], ids=["torch-tags", "package-tags"])
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_compiled_checkpointed_4bit_blocks_keep_only_what_eager_checkpointing_keeps(device, torch_tags, monkeypatch):
    """bitsandbytes' 4-bit matmul runs inside an autograd.Function (``MatMul4Bit``) once its input needs a gradient.
    Under torch 2.11, plain checkpointing in a compiled block left the ops inside it untagged, and the compiled
    forward saved every layer's matmul outputs (on an H100, +2.9 GiB at Llama-3.2-1B, 2 x 2048). Compiled blocks
    tag the recompute op by op (``traced_full_contexts``), so they keep what eager checkpointing keeps. Newer torch
    tags them itself (``torch_tags``); the package's tagging is checked on it too."""
    pytest.importorskip("bitsandbytes")
    from pl_lowprec.transforms import selective_checkpointing

    if torch_tags and not selective_checkpointing.TORCH_TAGS_TRACED_CHECKPOINTS:
        pytest.skip(f"torch {torch.__version__} does not tag checkpoints under compile itself")
    monkeypatch.setattr(selective_checkpointing, "TORCH_TAGS_TRACED_CHECKPOINTS", torch_tags)
    from pl_lowprec import set_activation_checkpointing
    from pl_lowprec.memory.activations import count_saved_tensors
    from pl_lowprec.transforms.lora import inject_lora, lora_config
    from pl_lowprec.transforms.quantization import QuantizationConfig, quantize_model

    dev = torch.device(device)

    def build(compiled: bool):
        torch.manual_seed(0)
        model = tiny_llama(hidden_size=64, layers=3).to(torch.bfloat16)
        quantize_model(model, QuantizationConfig.from_mode("nf4"), torch.bfloat16, dev)
        inject_lora(model.to(dev), lora_config({"r": 4}), ("lm_head",))
        set_activation_checkpointing(model, "LlamaDecoderLayer")
        if compiled:
            torch._dynamo.reset()
            compiling.compile_model(model, "LlamaDecoderLayer", {})
        return model

    ids = torch.randint(0, 256, (2, 64), generator=torch.Generator().manual_seed(1)).to(dev)
    # each layer's input needs a gradient: the 4-bit matmuls of every layer take the autograd.Function
    embeds = torch.randn(2, 64, 64, device=dev, dtype=torch.bfloat16, requires_grad=True)

    def saved_bytes(model) -> int:
        with torch.autocast(dev.type, dtype=torch.bfloat16), count_saved_tensors(model) as counter:
            loss = model.model(inputs_embeds=embeds, labels=ids, use_cache=False).loss
        loss.backward()
        return counter.nbytes

    compiled = build(compiled=True)
    assert all(layer.forward.compiled for layer in compiled.model.model.layers)
    watch = CompileWatch()
    saved_bytes(compiled)  # traces and compiles, with the saved tensors counted as MemoryTracker counts them
    assert watch.activity().graph_breaks == {}  # counting a checkpoint's inputs is left to the compiled graph
    eager_bytes, compiled_bytes = saved_bytes(build(compiled=False)), saved_bytes(compiled)
    # one layer's four full-width matmul outputs (q, o, gate+up... 2 x 64 x 64+ in bf16) are 16 KiB and more;
    # the three layers' outputs would add far more than this margin
    assert compiled_bytes <= eager_bytes + 8 * 1024, (compiled_bytes, eager_bytes)


class _Breaks(torch.nn.Module):
    def forward(self, x):
        x = x * 2
        torch._dynamo.graph_break()  # what a side effect in a hook would do
        return x + 1


def test_the_report_warns_of_each_graph_break_and_says_when_nothing_compiled(caplog):
    torch._dynamo.reset()
    clock = compiling.CompileClock()
    module = _Breaks()
    module.compile(backend="eager")
    clock.started(1)
    with caplog.at_level(logging.INFO, logger="lightning.pytorch.utilities.rank_zero"), pytest.warns(UserWarning) as w:
        module(torch.ones(3))
        clock.report_once()
    info = [m for m in caplog.messages if "torch.compile" in m]
    assert len(info) == 1 and info[0].startswith("torch.compile: 2 graphs (each forward and backward) compiled")
    assert "forward (test_compiling.py:" in info[0] and "1 graph breaks (warned below)" in info[0]
    warned = [str(r.message) for r in w if "torch.compile" in str(r.message)]
    assert len(warned) == 1 and warned[0].startswith("torch.compile broke the graph 1 times: Call to `torch._dynamo")
    assert "TORCH_LOGS=graph_breaks,recompiles shows where." in warned[0]

    caplog.clear()
    idle = compiling.CompileClock()
    idle.started(3)
    with caplog.at_level(logging.INFO, logger="lightning.pytorch.utilities.rank_zero"):
        idle.report_once()
    assert caplog.messages == [
        "torch.compile: nothing compiled up to the end of the first optimizer step (3 blocks were wrapped): every"
        " compiled block ran eagerly."
    ]
