"""``"auto"`` memory settings in ``fit``: chosen once before loading, for the device's free memory less 10% (or
``memory_budget``), said in one line, in effect on the model; the fast path learns what the memory-saving path
learns, up to rounding."""

import pytest
import torch
from lightning_helpers import quiet_trainer
from loading_helpers import save_llama
from qlora_helpers import GradRecorder, LossRecorder, ids_loader, tiny_llama

import pl_lowprec.memory.fastest as fastest
import pl_lowprec.strategies.auto_settings as auto_settings
from pl_lowprec import LowPrecisionStrategy, estimate_memory
from pl_lowprec.models import CausalLM
from pl_lowprec.transforms.checkpointing import is_checkpointed

pytest.importorskip("peft")
LORA = {"r": 4, "lora_alpha": 8}
AUTO = {"memory_saving": "auto", "activation_checkpointing": "auto"}
GiB = 2**30


def _fit(caplog, free=None, steps=2, **strategy):
    """Fit a tiny LoRA Llama under bf16-mixed with ``free`` bytes of available memory; the INFO lines, the strategy
    and the model."""
    torch.manual_seed(0)
    model = tiny_llama(hidden_size=64)
    built = LowPrecisionStrategy(lora=LORA, **strategy)
    trainer = quiet_trainer(strategy=built, precision="bf16-mixed", max_steps=steps)
    caplog.clear()
    with caplog.at_level("INFO"):
        trainer.fit(model, ids_loader(batches=2, batch_size=4, seq_len=64))
        trainer.fit(model, ids_loader(batches=2, batch_size=4, seq_len=64))  # a second fit chooses nothing again
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("Memory settings")]
    adapted = [r for r in caplog.records if r.getMessage().startswith("LoRA on 14 layers")]
    assert len(adapted) == 1  # the real transform says it; the simulated candidates do not repeat it
    assert adapted[0].getMessage().startswith("LoRA on 14 layers (r=4, lora_alpha=8);")  # what an overlay kept
    return lines, built, model


def _in_effect(model):
    """What the model runs: checkpointed blocks, fused MLPs, norms recomputed in backward."""
    blocks = [m for m in model.modules() if type(m).__name__ == "LlamaDecoderLayer"]
    mlps = [m for m in model.modules() if type(m).__name__ == "LlamaMLP"]
    norms = [m for m in model.modules() if type(m).__name__ == "LlamaRMSNorm"]
    return (
        [is_checkpointed(b) for b in blocks],
        all(getattr(m, "_pl_lowprec_fused_lora_mlp", False) for m in mlps),
        all(getattr(norm, "_pl_lowprec_recompute_norm", False) for norm in norms),
    )


def test_with_room_nothing_is_on_and_one_line_says_so(caplog, monkeypatch):
    monkeypatch.setattr(auto_settings, "available_memory", lambda device: 64 * GiB)
    lines, strategy, model = _fit(caplog, **AUTO)
    peak_and_time = lines[0].split("predicted peak ")[1].split("; the fastest")[0]  # a busy CPU's name has "; "
    assert lines == [
        "Memory settings for 57.60 GiB (64.00 GiB of available host memory, less 10%): no activation checkpointing,"
        f" MLP unfused, norms with their own backward; predicted peak {peak_and_time};"
        " the fastest settings: nothing is traded for memory."
    ]
    assert " s per step on this CPU" in peak_and_time  # the predicted step time, on the device it chose for
    assert _in_effect(model) == ([False, False], False, False)
    assert strategy.transform_config is strategy.transform.config  # the strategy holds what its transform applied
    assert strategy.transform_config.memory_saving == frozenset()


def test_little_free_memory_turns_everything_on(caplog, monkeypatch):
    batch = next(iter(ids_loader(batches=1, batch_size=4, seq_len=64)))
    blocks = ["LlamaDecoderLayer"]
    saving = estimate_memory(tiny_llama, batch, precision="bf16-mixed", lora=LORA, activation_checkpointing=blocks)
    monkeypatch.setattr(auto_settings, "available_memory", lambda device: int(saving.peak / 0.9) + 2)
    lines, _, model = _fit(caplog, **AUTO)
    assert len(lines) == 1 and "activation checkpointing on every block, fused LoRA MLP, norms recomputed" in lines[0]
    assert "; faster settings would need " in lines[0]  # what it gave up
    assert _in_effect(model) == ([True, True], True, True)


def test_explicit_settings_are_kept_under_a_budget(caplog):
    batch = next(iter(ids_loader(batches=1, batch_size=4, seq_len=64)))
    plain = estimate_memory(tiny_llama, batch, precision="bf16-mixed", lora=LORA, memory_saving=False)
    lines, strategy, model = _fit(
        caplog, memory_saving=False, activation_checkpointing="auto", memory_budget=plain.peak - 1
    )
    assert strategy.transform_config.memory_saving == frozenset()  # as given, though the paths would save memory
    assert "memory_budget=" in lines[0] and "selective activation checkpointing" in lines[0]
    assert _in_effect(model) == ([True, True], False, False)


def test_reentrant_checkpointing_says_selective_was_left_out(caplog, monkeypatch):
    """``checkpoint_impl: reentrant`` leaves selective checkpointing out of the candidates (audit 64b #6): the line
    says so where the search reached checkpointing, as it says what else it gave up; with room, nothing is said."""
    batch = next(iter(ids_loader(batches=1, batch_size=4, seq_len=64)))
    every_block = estimate_memory(
        tiny_llama,
        batch,
        precision="bf16-mixed",
        lora=LORA,
        activation_checkpointing=["LlamaDecoderLayer"],
        checkpoint_impl="reentrant",
    )
    lines, _, model = _fit(caplog, checkpoint_impl="reentrant", memory_budget=every_block.peak, **AUTO)
    assert len(lines) == 1 and "activation checkpointing on every block" in lines[0]
    assert lines[0].endswith(
        "; selective checkpointing left out: it runs non-reentrant only, and checkpoint_impl is reentrant."
    )
    assert _in_effect(model) == ([True, True], True, True)
    monkeypatch.setattr(auto_settings, "available_memory", lambda device: 64 * GiB)
    lines, _, _ = _fit(caplog, checkpoint_impl="reentrant", **AUTO)
    assert lines[0].endswith("the fastest settings: nothing is traded for memory.")


def test_nothing_fits_free_memory_warns_and_trains_with_the_most_memory_saving(caplog, monkeypatch):
    monkeypatch.setattr(auto_settings, "available_memory", lambda device: 2**20)
    with pytest.warns(UserWarning, match=r"No settings fit in 0\.90 MiB \(1\.00 MiB of available host memory, less"):
        lines, strategy, model = _fit(caplog, steps=1, **AUTO)
    assert lines == [] and strategy.lightning_module.trainer.global_step == 1
    assert _in_effect(model) == ([True, True], True, True)


def test_the_fast_path_learns_what_the_memory_saving_path_learns(tmp_path, monkeypatch):
    """A tiny QLoRA CausalLM, 3 steps from one seed: the memory-saving path (fused MLP, norms and cross-entropy a
    few rows at a time, the loss in chunks, every block checkpointed) against the fast path (none of them): the same
    losses and adapter gradients, up to the order of floating-point sums."""
    pytest.importorskip("bitsandbytes")
    directory = save_llama(tmp_path / "model", hidden_size=64, layers=2)
    monkeypatch.setattr("pl_lowprec.models.causal_lm.AUTO_LOSS_CHUNK", 16)  # 2 chunks of the 32 positions
    monkeypatch.setattr("pl_lowprec.models.cross_entropy.ROW_ELEMENTS", 256 * 8)  # 8 rows a group
    monkeypatch.setattr("pl_lowprec.transforms.autocast_activations.ROW_ELEMENTS", 64 * 8)
    monkeypatch.setattr("pl_lowprec.transforms.fused_lora_mlp.CHUNK_ELEMENTS", 64 * 8)

    def train(**strategy):
        torch.manual_seed(0)
        module = CausalLM(str(directory), lr=1e-2, warmup_steps=1, loss_chunk_size="auto")
        grads, losses = GradRecorder(), LossRecorder()
        built = LowPrecisionStrategy(quantization="nf4-dq", lora={**LORA, "lora_dropout": 0.0}, **strategy)
        trainer = quiet_trainer(strategy=built, precision="bf16-mixed", max_steps=3, callbacks=[grads, losses])
        rows = [{"input_ids": ids, "labels": ids} for ids in torch.randint(0, 256, (12, 33))]
        trainer.fit(module, torch.utils.data.DataLoader(rows, batch_size=4))
        return losses.losses, grads.grads, module

    saving_losses, saving_grads, saving = train(memory_saving=True, activation_checkpointing=["LlamaDecoderLayer"])
    fast_losses, fast_grads, fast = train(memory_saving=False)
    assert saving.loss_chunk == 16 and saving.grouped_cross_entropy
    assert fast.loss_chunk is None and not fast.grouped_cross_entropy
    torch.testing.assert_close(torch.tensor(fast_losses), torch.tensor(saving_losses), rtol=1e-5, atol=0)
    for step, (fast_step, saving_step) in enumerate(zip(fast_grads, saving_grads, strict=True)):
        assert fast_step.keys() == saving_step.keys() and fast_step
        for name, grad in fast_step.items():
            torch.testing.assert_close(grad, saving_step[name], rtol=1e-3, atol=1e-6, msg=f"step {step}: {name}")


def test_the_ordering_is_one_function_of_the_settings():
    """The lead's hook: candidates are ranked by ``predicted_seconds`` alone."""
    order = fastest.candidates(fastest.TransformConfig(lora=LORA, **AUTO), fastest.ALL_PATHS, ["LlamaDecoderLayer"])
    ranks = [fastest.predicted_seconds(None, settings) for settings in order]
    assert ranks == sorted(ranks) and len(order) == 6


class _Strategy:
    """What ``memory_limit`` reads from a strategy: 2 processes on one host (DDP on CPU), a reduce across them."""

    world_size = 2
    parallel_devices = [torch.device("cpu")] * 2

    def reduce(self, tensor, reduce_op):
        assert reduce_op == "min"
        return torch.minimum(tensor, torch.tensor(30 * GiB))  # the other rank sees 30 GiB free


def test_the_memory_is_the_least_of_all_ranks_shared_on_one_host_less_the_margin(monkeypatch):
    monkeypatch.setattr(auto_settings, "available_memory", lambda device: 40 * GiB)
    limit, said = auto_settings.memory_limit(_Strategy(), torch.device("cpu"), None)
    assert limit == int(30 * GiB / 2 * 0.9)
    assert said == "30.00 GiB of available host memory, the least of all ranks, shared by 2 processes, less 10%"
    assert auto_settings.memory_limit(_Strategy(), torch.device("cpu"), 5 * GiB) == (5 * GiB, "memory_budget=5.00 GiB")


def test_validating_before_fit_runs_the_memory_saving_side_and_fit_keeps_it_saying_so(caplog, monkeypatch):
    """The transform installs what it is given and a later one keeps it: a fit after validate cannot take the fast
    side, and before, its line named the fast settings while the blocks stayed checkpointed."""
    monkeypatch.setattr(auto_settings, "available_memory", lambda device: 64 * GiB)
    torch.manual_seed(0)
    model = tiny_llama(hidden_size=64)
    trainer = quiet_trainer(strategy=LowPrecisionStrategy(lora=LORA, **AUTO), precision="bf16-mixed", max_steps=1)
    loader = ids_loader(batches=2, batch_size=4, seq_len=64)
    with caplog.at_level("INFO"):
        trainer.validate(model, loader)
        trainer.validate(model, loader)
        trainer.fit(model, loader)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("Memory settings")]
    assert lines[0].startswith("Memory settings: 'auto' is chosen when fitting; validate runs the memory-saving side")
    assert len(lines) == 2 and lines[1].startswith("Memory settings: the model was transformed on the memory-saving")
    assert _in_effect(model) == ([True, True], True, True)  # what the lines say it runs
    assert trainer.strategy.transform_config.chooses_automatically  # nothing chose: 'auto' is the saving side
