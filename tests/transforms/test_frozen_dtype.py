"""Under mixed precision, frozen unquantized weights keep the compute dtype; trainable ones and norms are fp32."""

import json
import re
import sys
from pathlib import Path

import pytest
import torch
import warm_python
from lightning.pytorch.callbacks import Callback
from lightning_helpers import quiet_trainer
from loading_helpers import llama_config, save_llama, save_tokenizer

from pl_lowprec import LowPrecisionStrategy
from pl_lowprec.data import TextDataModule
from pl_lowprec.models import CausalLM
from pl_lowprec.transforms.frozen_dtype import cast_frozen_weights
from pl_lowprec.transforms.lora import is_norm

pytest.importorskip("peft")
pytest.importorskip("bitsandbytes")


def _float_params(model):
    """(name, dtype, trainable, in a norm) of every plain floating-point parameter."""
    norms = {id(p) for m in model.modules() if is_norm(m) for p in m.parameters(recurse=False)}
    return [
        (name, p.dtype, p.requires_grad, id(p) in norms)
        for name, p in model.named_parameters()
        if type(p.data) is torch.Tensor and p.is_floating_point()
    ]


def test_frozen_weights_cast_trainable_and_norms_kept():
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM(llama_config(hidden_size=32, layers=1))
    model.requires_grad_(False)
    model.model.layers[0].mlp.down_proj.weight.requires_grad_(True)
    saved = cast_frozen_weights(model, torch.bfloat16)
    params = _float_params(model)
    frozen = [dtype for _, dtype, trainable, norm in params if not trainable and not norm]
    assert frozen and set(frozen) == {torch.bfloat16}
    assert {dtype for _, dtype, trainable, norm in params if trainable or norm} == {torch.float32}
    assert saved == sum(p.numel() * 2 for p in model.parameters() if p.dtype == torch.bfloat16)
    assert cast_frozen_weights(model, torch.float32) == 0  # 32-true: nothing changes


def test_frozen_scalars_and_vectors_read_elementwise_keep_fp32():
    """A module of one's own with a frozen logit temperature and LayerScale gamma: bf16 would round exp(scale) from
    14.2857 to 14.25, which no autocast op would; the matmul weights, their biases and the embedding are cast."""
    import math

    from torch import nn

    class LayerScaled(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(8, 4)
            self.proj = nn.Linear(4, 4)
            self.gamma = nn.Parameter(torch.full((4,), 0.101))
            self.logit_scale = nn.Parameter(torch.tensor(math.log(1 / 0.07)))

    model = LayerScaled().requires_grad_(False)
    cast_frozen_weights(model, torch.bfloat16)
    dtypes = {name: p.dtype for name, p in model.named_parameters()}
    assert dtypes == {
        "emb.weight": torch.bfloat16,
        "proj.weight": torch.bfloat16,
        "proj.bias": torch.bfloat16,
        "gamma": torch.float32,
        "logit_scale": torch.float32,
    }
    assert float(model.logit_scale.exp()) == pytest.approx(1 / 0.07, rel=1e-6)


def test_what_a_transformers_model_keeps_in_fp32_stays_fp32():
    """Ernie-4.5-MoE declares its router weight and expert-score bias fp32 (``_keep_in_fp32_modules_strict``) and
    reads them with autocast off; its experts and projections are cast."""
    from transformers import Ernie4_5_MoeConfig, Ernie4_5_MoeForCausalLM

    config = Ernie4_5_MoeConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        moe_intermediate_size=8,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        moe_num_experts=4,
        moe_k=2,
        moe_layer_start_index=0,
    )
    model = Ernie4_5_MoeForCausalLM(config).requires_grad_(False)
    cast_frozen_weights(model, torch.bfloat16)
    dtypes = {name: p.dtype for name, p in model.named_parameters()}
    assert dtypes["model.layers.0.mlp.gate.weight"] == torch.float32
    assert dtypes["model.layers.0.mlp.gate.moe_statics.e_score_correction_bias"] == torch.float32
    assert dtypes["model.layers.0.mlp.experts.gate_up_proj"] == torch.bfloat16
    assert dtypes["model.layers.0.mlp.shared_experts.gate_proj.weight"] == torch.bfloat16
    assert dtypes["model.embed_tokens.weight"] == torch.bfloat16


def test_fp16_overflow_is_refused_naming_the_weight():
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM(llama_config(hidden_size=32, layers=1)).requires_grad_(False)
    with torch.no_grad():
        model.model.embed_tokens.weight[0, 0] = 1e6
    with pytest.raises(ValueError, match=r"model\.embed_tokens\.weight holds values up to 1e\+06.*bf16-mixed"):
        cast_frozen_weights(model, torch.float16)


class Losses(Callback):
    def __init__(self):
        self.losses = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses.append(float(outputs["loss"]))


@pytest.fixture(scope="module")
def bf16_checkpoint(tmp_path_factory):
    """A bf16 checkpoint with a tied embedding, as real chat checkpoints ship."""
    directory = save_tokenizer(tmp_path_factory.mktemp("bf16"))
    from transformers import AutoTokenizer

    vocab = len(AutoTokenizer.from_pretrained(directory))
    return save_llama(directory, hidden_size=32, layers=1, vocab_size=vocab, tie=True, dtype=torch.bfloat16)


@pytest.mark.parametrize(("precision", "frozen_dtype"), [("bf16-mixed", torch.bfloat16), ("32-true", torch.float32)])
def test_qlora_on_a_bf16_checkpoint_keeps_frozen_weights_in_the_compute_dtype(
    tmp_path, bf16_checkpoint, precision, frozen_dtype
):
    path = tmp_path / "pc.jsonl"
    path.write_text("\n".join(json.dumps({"prompt": f"x{i} =", "completion": f" {i}"}) for i in range(8)))
    data = TextDataModule(train_files=path, tokenizer=str(bf16_checkpoint), batch_size=4, val_fraction=0)
    losses = Losses()
    strategy = LowPrecisionStrategy(quantization="nf4", lora={"r": 4, "lora_alpha": 8})
    trainer = quiet_trainer(strategy=strategy, precision=precision, max_steps=2, callbacks=[losses])
    model = CausalLM(str(bf16_checkpoint))
    trainer.fit(model, datamodule=data)
    params = _float_params(model)
    assert any("embed_tokens" in name for name, *_ in params)
    for name, dtype, trainable, norm in params:
        expected = torch.float32 if trainable or norm else frozen_dtype
        assert dtype == expected, (name, dtype)
    assert len(losses.losses) == 2 and all(torch.isfinite(torch.tensor(losses.losses)))


def test_a_trained_model_runs_outside_autocast_as_under_it(tmp_path, bf16_checkpoint):
    """Frozen bf16 layers meet fp32 norm outputs outside autocast: they cast their input, and return fp32."""
    path = tmp_path / "pc.jsonl"
    path.write_text("\n".join(json.dumps({"prompt": f"x{i} =", "completion": f" {i}"}) for i in range(8)))
    data = TextDataModule(train_files=path, tokenizer=str(bf16_checkpoint), batch_size=4, val_fraction=0)
    strategy = LowPrecisionStrategy(lora={"r": 4, "lora_alpha": 8})  # unquantized: every base linear is frozen bf16
    trainer = quiet_trainer(strategy=strategy, precision="bf16-mixed", max_steps=1)
    model = CausalLM(str(bf16_checkpoint))
    trainer.fit(model, datamodule=data)
    head = model.model.get_output_embeddings()
    assert head.weight.dtype == torch.bfloat16 and model.model.model.norm.weight.dtype == torch.float32
    ids = torch.arange(12).reshape(2, 6)
    with torch.no_grad():
        plain = model(ids)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            autocast = model(ids)
    assert plain.dtype == torch.float32  # the head returns its input's dtype, as bitsandbytes' layers do
    torch.testing.assert_close(plain, autocast.float(), atol=0.05, rtol=0.05)


class _DictAccessLog(dict):
    """A module's ``__dict__`` that records ``pop`` calls."""

    pops = 0

    def pop(self, *args):
        type(self).pops += 1
        return super().pop(*args)


def test_under_autocast_the_cast_hooks_leave_the_modules_dict_alone():
    """Training runs under autocast, where the hooks cast nothing. They must not touch ``module.__dict__`` then:
    torch.compile before 2.13 cannot trace ``__dict__.pop`` and broke every compiled block there (seen on an H200
    with torch 2.11). Outside autocast they still cast in and back."""
    layer = torch.nn.Linear(4, 4).requires_grad_(False)
    assert cast_frozen_weights(layer, torch.bfloat16) > 0
    layer.__dict__ = _DictAccessLog(layer.__dict__)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert layer(torch.ones(2, 4)).dtype == torch.bfloat16
    assert _DictAccessLog.pops == 0
    assert layer(torch.ones(2, 4)).dtype == torch.float32 and _DictAccessLog.pops == 1


def test_a_ranks_rows_streamed_in_under_fsdp2_are_cast_too(tmp_path):
    """FSDP2's streamed load leaves each frozen weight as a DTensor of the rank's rows (``mesh.local_rows``):
    they stayed fp32 before, twice what the estimate counted, and the rows' all-gathers twice as large."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    from pl_lowprec.distributed.mesh import local_rows

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        embedding = torch.nn.Embedding(64, 8)
        embedding.weight = torch.nn.Parameter(local_rows(embedding.weight.detach(), mesh), requires_grad=False)
        norm = torch.nn.LayerNorm(8)
        norm.weight = torch.nn.Parameter(local_rows(norm.weight.detach(), mesh), requires_grad=False)
        head = torch.nn.Linear(8, 64, bias=False)
        head.weight = embedding.weight  # tied, as SmolLM2's and Llama-3.2-1B's
        model = torch.nn.Sequential(embedding, norm, head)
        saved = cast_frozen_weights(model, torch.bfloat16)
        weight = model[0].weight
        assert isinstance(weight, DTensor) and weight.dtype == torch.bfloat16
        assert weight.to_local().dtype == torch.bfloat16 and weight.placements == (Shard(0),)
        assert saved == 64 * 8 * 2  # this rank's rows, 2 bytes less each
        assert model[1].weight.dtype == torch.float32  # norms stay fp32
        assert model[2].weight is weight  # still tied: cast once, counted once
        large = torch.nn.Embedding(4, 8)
        with torch.no_grad():
            large.weight[1, 2] = 1e6
        large.weight = torch.nn.Parameter(local_rows(large.weight.detach(), mesh), requires_grad=False)
        with pytest.raises(ValueError, match=r"frozen weight 0\.weight holds values up to 1e\+06.*bf16-mixed"):
            cast_frozen_weights(torch.nn.Sequential(large), torch.float16)  # refused on every rank together
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize(
    ("backend", "mesh_device"),
    [("gloo", "cpu"), pytest.param("nccl", "cuda", marks=pytest.mark.cuda)],
)
def test_rows_in_cpu_memory_are_checked_over_the_meshs_own_device(tmp_path, backend, mesh_device):
    """Under ``cpu_offload=True`` a rank's rows stay in CPU memory while the mesh and its process group are
    CUDA's: the overflow is reduced on the mesh's device (NCCL takes no CPU tensors), and the refusal is the same.
    The rows are FSDP2's own, sharded with its CPU offload policy where the mesh is CUDA's."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy, fully_shard

    dist.init_process_group(backend, init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        if mesh_device == "cuda":
            torch.cuda.set_device(0)
        mesh = init_device_mesh(mesh_device, (1,))
        large = torch.nn.Embedding(4, 8)
        with torch.no_grad():
            large.weight[1, 2] = 1e6
        large.weight.requires_grad_(False)
        offload = CPUOffloadPolicy() if mesh_device == "cuda" else OffloadPolicy()
        fully_shard(large, mesh=mesh, offload_policy=offload)
        assert large.weight.device_mesh.device_type == mesh_device
        assert large.weight.to_local().device.type == "cpu"
        with pytest.raises(ValueError, match=r"frozen weight 0\.weight holds values up to 1e\+06"):
            cast_frozen_weights(torch.nn.Sequential(large), torch.float16)
    finally:
        dist.destroy_process_group()


def test_a_value_beyond_float16_on_one_rank_is_refused_on_every_rank(tmp_path):
    """Only rank 0's rows hold the value float16 cannot; rank 1 must refuse too, with the same message, or it
    would train on and wait in FSDP2's next all-gather for a rank that stopped."""
    script = Path(__file__).parents[1] / "_scripts" / "fp16_range_ranks.py"
    result = warm_python.run([sys.executable, str(script), str(tmp_path)], timeout=120, ranks=2)
    assert result.returncode == 0, result.stderr[-4000:]
    said = [(tmp_path / f"rank{rank}.txt").read_text() for rank in (0, 1)]
    assert said[0] == said[1]
    assert re.search(r"frozen weight 0\.weight holds values up to 1e\+06, beyond float16's range", said[1])
