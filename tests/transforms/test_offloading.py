"""Activation offloading: identical gradients, device bytes for backward drop to what stays, host bytes rise.

On CPU there is nothing to offload, so the strategy refuses it (tested); the Trainer tests patch that device check
to run the same hooks here, with host copies standing in for the device-to-host moves.
"""

import pytest
import torch
from lightning_helpers import quiet_trainer

from pl_lowprec import AMPPrecision, LowPrecisionStrategy, MemoryTracker, estimate_memory
from pl_lowprec.demo.tiny_gpt import TinyGPT
from pl_lowprec.memory.activations import count_saved_tensors
from pl_lowprec.transforms import pipeline as transform
from pl_lowprec.transforms.offloading import OffloadActivations


def _gpt():
    torch.manual_seed(0)
    return TinyGPT(dim=32, layers=2, heads=2, max_len=64, warmup_steps=1)


def _batch():
    return {"input_ids": torch.randint(0, 256, (4, 33), generator=torch.Generator().manual_seed(0))}


def _loader(batches=2):
    ids = torch.randint(0, 256, (batches * 4, 33), generator=torch.Generator().manual_seed(0))
    return torch.utils.data.DataLoader([{"input_ids": r} for r in ids], batch_size=4)


@pytest.fixture
def offload_on_cpu(monkeypatch, tmp_path):
    monkeypatch.setattr(transform, "check_offload_device", lambda device: None)
    monkeypatch.chdir(tmp_path)  # MemoryTracker writes its summary into the working directory


def _fit_grads(offloading, checkpointing, precision, steps=2, accelerator="cpu"):
    grads = []

    class Recorder(MemoryTracker):
        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            super().on_before_optimizer_step(trainer, pl_module, optimizer)
            grads.append({n: p.grad.clone() for n, p in pl_module.named_parameters()})

    strategy = LowPrecisionStrategy(
        activation_checkpointing=["Block"] if checkpointing else None, activation_offloading=offloading
    )
    tracker = Recorder(print_summary=False)
    plugins = [AMPPrecision(precision)] if precision else []
    trainer = quiet_trainer(
        accelerator=accelerator, strategy=strategy, plugins=plugins, max_steps=steps, callbacks=[tracker]
    )
    trainer.fit(_gpt(), _loader(steps))
    return grads, tracker.summary["fit"]["bytes"]


@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "checkpointed"])
@pytest.mark.parametrize("precision", [None, "bf16-mixed"], ids=["fp32", "bf16-mixed"])
def test_gradients_identical_and_saved_bytes_move_to_host(offload_on_cpu, precision, checkpointing):
    expected, plain = _fit_grads(False, checkpointing, precision)
    actual, offloaded = _fit_grads(True, checkpointing, precision)
    for step_expected, step_actual in zip(expected, actual, strict=True):
        for name, grad in step_expected.items():
            assert torch.equal(step_actual[name], grad), name  # bit for bit
    # What stays on the device: the tensors under 1024 bytes, LayerNorm's mean and rstd ([4, 32, 1] fp32, 512 bytes
    # each) of the LayerNorms that are not inside a checkpointed block, and the 4-byte loss.
    layer_norms_outside_blocks = 1 if checkpointing else 5
    assert offloaded["activations"] == layer_norms_outside_blocks * 2 * 512 + 4 < plain["activations"] // 10
    assert offloaded["activations_offloaded_to_host"] >= plain["activations"] - offloaded["activations"] - 64
    assert "activations_offloaded_to_host" not in plain


def test_nothing_stays_on_the_device_with_no_size_threshold():
    model = _gpt()
    with count_saved_tensors(model) as counter, OffloadActivations(torch.device("cpu"), model.parameters(), 1):
        loss = model.training_step(_batch(), 0)
    assert counter.nbytes == 0
    assert counter.offloaded_nbytes > 500_000
    loss.backward()


def test_with_checkpointing_only_the_block_inputs_and_what_runs_outside_blocks_move():
    from pl_lowprec import set_activation_checkpointing

    model = _gpt()
    set_activation_checkpointing(model, ["Block"])
    with count_saved_tensors(model) as kept:  # no offloading: what checkpointing leaves saved
        model.training_step(_batch(), 0)
    with count_saved_tensors(model) as counter, OffloadActivations(torch.device("cpu"), model.parameters(), 1):
        model.training_step(_batch(), 0)
    assert counter.nbytes == 0
    assert abs(counter.offloaded_nbytes - kept.nbytes) <= 64  # the same tensors, now on the host
    block_input = 4 * 33 * 32 * 4  # [batch, tokens, dim] fp32, one per checkpointed block
    assert kept.nbytes > 2 * block_input


def test_estimate_moves_the_same_bytes_as_measured(offload_on_cpu):
    _, measured = _fit_grads(True, True, None, steps=1)
    estimate = estimate_memory(_gpt, _batch(), activation_checkpointing=["Block"], activation_offloading=True)
    assert estimate.activations == measured["activations"]
    assert estimate.activations_offloaded_to_host == measured["activations_offloaded_to_host"]
    without = estimate_memory(_gpt, _batch(), activation_checkpointing=["Block"])
    assert estimate.total < without.total  # device bytes drop
    assert "activations_offloaded_to_host" in estimate.as_dict()


def test_offloading_on_cpu_is_refused_before_training():
    model = _gpt()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    trainer = quiet_trainer(strategy=LowPrecisionStrategy(activation_offloading=True), max_steps=1)
    with pytest.raises(ValueError, match=r"trains on cpu, where they already are: there is nothing to offload"):
        trainer.fit(model, _loader())
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())


def test_offloading_takes_a_bool():
    with pytest.raises(TypeError, match="activation_offloading takes True or False, got 'yes'"):
        LowPrecisionStrategy(activation_offloading="yes")


@pytest.mark.cuda
def test_cuda_offloading_overlaps_on_a_side_stream_with_identical_gradients():
    device = torch.device("cuda")
    model = _gpt().to(device)
    batch = {k: v.to(device) for k, v in _batch().items()}
    model.training_step(batch, 0).backward()
    expected = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    offload = OffloadActivations(device, model.parameters())
    assert offload._stream is not None and offload._stream != torch.cuda.current_stream()
    with count_saved_tensors(model) as counter, offload:
        loss = model.training_step(batch, 0)
    loss.backward()
    torch.cuda.synchronize()
    # What stays: tensors under min_bytes (flash attention's RNG state and log-sum-exp, LayerNorm statistics).
    assert counter.offloaded_nbytes > 500_000 and counter.nbytes < counter.offloaded_nbytes // 50
    for name, grad in expected.items():
        assert torch.equal(model.get_parameter(name).grad, grad), name


@pytest.mark.cuda
@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "checkpointed"])
def test_the_strategy_offloads_on_cuda_with_the_same_gradients(tmp_path, monkeypatch, checkpointing):
    monkeypatch.chdir(tmp_path)
    expected, plain = _fit_grads(False, checkpointing, "bf16-mixed", accelerator="cuda")
    actual, offloaded = _fit_grads(True, checkpointing, "bf16-mixed", accelerator="cuda")
    for step_expected, step_actual in zip(expected, actual, strict=True):
        for name, grad in step_expected.items():
            torch.testing.assert_close(step_actual[name], grad, rtol=1e-5, atol=1e-7, msg=name)
    assert offloaded["activations"] < plain["activations"] // 10
    assert offloaded["activations_offloaded_to_host"] >= plain["activations"] // 2


def test_a_tensor_saved_by_several_ops_is_copied_once():
    x = torch.randn(1024, requires_grad=True)
    weights = [torch.randn(1024, requires_grad=True) for _ in range(3)]
    with count_saved_tensors() as counter, OffloadActivations(torch.device("cpu"), exclude=weights):
        loss = sum((x * w).sum() for w in weights)  # each mul saves x (and its weight, excluded here)
    loss.backward()
    assert counter.offloaded_nbytes == 1024 * 4  # x, once
    assert counter.nbytes == 3 * 1024 * 4  # the excluded weights stay
    offloaded, x.grad = x.grad, None
    sum((x * w).sum() for w in weights).backward()
    assert torch.equal(offloaded, x.grad)


def test_causal_lm_chunked_loss_with_frozen_bf16_head_offloads_with_the_same_gradients(offload_on_cpu, tmp_path):
    """The user's QLoRA path: CausalLM's loss chunks are strided views of the hidden states, which the frozen bf16
    head reads as they are; offloading hands their recompute a dense copy. The recompute must match (it failed with
    a CheckpointError), and the gradients equal those without offloading."""
    from loading_helpers import save_llama

    from pl_lowprec.models import CausalLM

    directory = save_llama(tmp_path / "model", hidden_size=32, layers=2, dtype=torch.bfloat16)
    ids = torch.randint(0, 256, (8, 33), generator=torch.Generator().manual_seed(0))
    loader = torch.utils.data.DataLoader([{"input_ids": r, "labels": r} for r in ids], batch_size=4)

    class Recorder(MemoryTracker):
        def __init__(self):
            super().__init__(print_summary=False)
            self.grads = []

        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            self.grads.append({n: p.grad.clone() for n, p in pl_module.named_parameters() if p.grad is not None})

    grads = {}
    for offloading in (False, True):
        recorder = Recorder()
        strategy = LowPrecisionStrategy(
            quantization="nf4-dq",
            lora={"r": 4, "lora_alpha": 8},
            activation_checkpointing=["LlamaDecoderLayer"],
            activation_offloading=offloading,
        )
        trainer = quiet_trainer(
            strategy=strategy, plugins=[AMPPrecision("bf16-mixed")], max_steps=2, callbacks=[recorder]
        )
        torch.manual_seed(0)
        trainer.fit(CausalLM(str(directory), loss_chunk_size=8), loader)
        grads[offloading] = recorder.grads
    assert len(grads[True]) == len(grads[False]) == 2 and grads[True][0]
    for with_offloading, without in zip(grads[True], grads[False], strict=True):
        for name, grad in without.items():
            torch.testing.assert_close(with_offloading[name], grad, rtol=0, atol=0, msg=name)
