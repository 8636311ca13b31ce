"""``memory_budget=``: fit predicts the step's peak first, stops a run above the budget before any step (naming
what the plan would change), and leaves a run that fits exactly as it would have been."""

import re
import sys
from pathlib import Path

import pytest
import torch
import warm_python
from lightning.pytorch.callbacks import Callback
from lightning_helpers import quiet_trainer
from qlora_helpers import tiny_llama
from torch.utils.data import DataLoader

from pl_lowprec import LowPrecisionStrategy, estimate_memory
from pl_lowprec.memory.fake_model import meta_copy

pytest.importorskip("peft")
LORA = {"r": 4, "lora_alpha": 8}
ROOT = Path(__file__).resolve().parents[2]


class Losses(Callback):
    def __init__(self):
        self.losses = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses.append(float(outputs["loss"]))


def _loader(batch_size=8):
    """Shuffled, so a guard that drew from the run's random state would change the batches."""
    g = torch.Generator().manual_seed(0)
    rows = [{"input_ids": torch.randint(0, 256, (33,), generator=g)} for _ in range(16)]
    return DataLoader(rows, batch_size=batch_size, shuffle=True)


def _fit(memory_budget=None, steps=2, batch_size=8, **strategy):
    torch.manual_seed(0)
    model = tiny_llama(hidden_size=64)
    losses = Losses()
    strategy = LowPrecisionStrategy(lora=LORA, memory_budget=memory_budget, **strategy)
    trainer = quiet_trainer(strategy=strategy, precision="bf16-mixed", max_steps=steps, callbacks=[losses])
    trainer.fit(model, _loader(batch_size))
    return trainer, model, losses.losses


def _predicted_peak(**strategy):
    batch = next(iter(_loader(batch_size=2)))
    build = lambda: tiny_llama(hidden_size=64)  # noqa: E731
    return estimate_memory(build, batch, precision="bf16-mixed", lora=LORA, **strategy).peak


def test_a_run_that_fits_trains_as_without_the_budget(caplog):
    _, _, reference = _fit()
    caplog.clear()
    with caplog.at_level("INFO"):
        trainer, _, losses = _fit(memory_budget="1GiB")
    assert trainer.global_step == 2
    assert losses == reference  # same batches, same steps: the check drew nothing from the run's random state
    assert "memory_budget=1.00 GiB: the predicted peak is" in caplog.text and "of headroom" in caplog.text
    assert caplog.text.count("LoRA on ") == 1  # the run's own setup line; the simulated step's is silent


def test_a_run_above_the_budget_stops_before_any_step_naming_the_plan():
    given = {"optimizer": "adamw8bit"}  # the optimizer given: the plan simulates no 8-bit variant of each candidate
    unconstrained = _predicted_peak(**given)
    checkpointed = _predicted_peak(activation_checkpointing=["LlamaDecoderLayer"], **given)
    assert checkpointed < unconstrained
    budget = (checkpointed + unconstrained) // 2  # fits only with a change the plan can make
    torch.manual_seed(0)
    model = tiny_llama(hidden_size=64)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    strategy = LowPrecisionStrategy(lora=LORA, memory_budget=budget, **given)
    trainer = quiet_trainer(strategy=strategy, precision="bf16-mixed", max_steps=2)
    with pytest.raises(ValueError) as refused:
        trainer.fit(model, _loader(batch_size=2))  # the plan simulates micro-batches 2 and 1
    message = str(refused.value)
    assert f"the predicted peak of this run is {unconstrained / 2**20:.2f} MiB" in message
    assert "above the budget, so it was stopped before loading any weight" in message
    assert "The plan for this budget and the same global batch:" in message and "pl-lowprec plan" in message
    assert trainer.global_step == 0
    for name, param in model.named_parameters():
        torch.testing.assert_close(param, before[name], rtol=0, atol=0, msg=name)  # nothing transformed


def test_above_the_budget_the_plan_searches_the_auto_settings_as_given():
    """With ``"auto"`` settings and nothing fitting at the run's micro-batch, the refusal's plan searches the
    settings as the config gives them ("auto"), not the most memory-saving ones the choice ended on (every block
    checkpointed, which the plan would keep as given): at one row a micro-batch every 2nd block is enough."""
    build = lambda: tiny_llama(hidden_size=64)  # noqa: E731
    # the optimizer given: the plan has no 8-bit variant of each candidate to simulate besides
    blocks = {"activation_checkpointing": ["LlamaDecoderLayer"], "optimizer": "adamw8bit"}
    saving = estimate_memory(build, next(iter(_loader(batch_size=2))), precision="bf16-mixed", lora=LORA, **blocks)
    every_2nd_one_row = estimate_memory(
        build,
        next(iter(_loader(batch_size=1))),
        precision="bf16-mixed",
        lora=LORA,
        checkpoint_every_n=2,
        accumulate_grad_batches=2,
        **blocks,
    )
    assert every_2nd_one_row.peak < saving.peak
    auto = {"memory_saving": "auto", "activation_checkpointing": "auto"}
    with pytest.raises(ValueError) as refused:
        _fit(memory_budget=(every_2nd_one_row.peak + saving.peak) // 2, batch_size=2, optimizer="adamw8bit", **auto)
    assert (
        "The plan for this budget and the same global batch: micro-batch 1 x 2, activation checkpointing on every 2nd"
        " block, fused LoRA MLP, norms recomputed row-wise, optimizer adamw8bit"
        f" (predicted {every_2nd_one_row.peak / 2**20:.2f} MiB)"
    ) in str(refused.value)


@pytest.fixture
def fake_steps(monkeypatch):
    """``(config, accumulation, batch shape)`` of each fake step the estimator simulates, in order."""
    import pl_lowprec.memory.estimate as estimate_module

    simulated = []
    real_estimate = estimate_module._estimate

    def counted(build, batch, precision, device, config, accumulate, *rest):
        simulated.append((config, accumulate, next(iter(batch.values())).shape))
        return real_estimate(build, batch, precision, device, config, accumulate, *rest)

    monkeypatch.setattr(estimate_module, "_estimate", counted)
    return simulated


def repeats(simulated: list) -> list:
    """The fake steps that simulated again what one before them did."""
    return [s for i, s in enumerate(simulated) if s in simulated[:i]]


def test_a_budget_below_anything_possible_says_what_dominates(caplog, fake_steps):
    expected = r"memory_budget=1\.00 KiB: .*Nothing fits in 1\.00 KiB.*The largest part is"  # not "0.00 MiB"
    with caplog.at_level("INFO"), pytest.raises(ValueError, match=expected):
        _fit(memory_budget="1KiB", batch_size=1)  # every candidate is simulated: keep them few
    # the simulated candidates set up no model: their setup lines (once per candidate) are silent
    assert "LoRA on " not in caplog.text and "Activation checkpointing" not in caplog.text, caplog.text
    assert len(fake_steps) > 1 and not repeats(fake_steps)  # the plan takes the check's estimate of the run as given


class CountingLoader(DataLoader):
    """Counts the iterators drawn from it: each is a batch drawn before the run."""

    drawn = 0

    def __iter__(self):
        CountingLoader.drawn += 1
        return super().__iter__()


def test_the_automatic_choice_and_the_budget_check_draw_one_batch_and_simulate_each_config_once(fake_steps):
    """The refusal's plan takes the estimates the automatic choice made (a fake step costs seconds each)."""
    simulated = fake_steps
    rows = list(_loader(batch_size=1).dataset)
    loader = CountingLoader(rows, batch_size=1)
    CountingLoader.drawn = 0
    strategy = LowPrecisionStrategy(
        lora=LORA, memory_budget="1KiB", memory_saving="auto", activation_checkpointing="auto"
    )
    trainer = quiet_trainer(strategy=strategy, precision="bf16-mixed", max_steps=1)
    with pytest.raises(ValueError, match=r"memory_budget=1\.00 KiB: .*Nothing fits"):
        trainer.fit(tiny_llama(hidden_size=64), loader)
    assert CountingLoader.drawn == 1  # the refusal's plan reuses the batch the choice simulated
    choice = [config for _, config, _ in strategy.automatic_choice.tried]
    assert len(choice) >= 4 and [config for config, _, _ in simulated[: len(choice)]] == choice
    assert len(simulated) > len(choice)  # the plan's own candidates (the 8-bit optimizer) were simulated
    assert not repeats(simulated), f"{len(repeats(simulated))} of {len(simulated)} fake steps made twice"


def test_small_sizes_read_as_sizes():
    from pl_lowprec.memory.sizes import format_bytes

    sizes = [0, 1023, 1024, 10_000, 11_000, 2**20, 3 * 2**30]
    assert [format_bytes(n) for n in sizes] == [
        "0 bytes",
        "1023 bytes",
        "1.00 KiB",
        "9.77 KiB",
        "0.01 MiB",
        "1.00 MiB",
        "3.00 GiB",
    ]


def test_a_memory_that_must_be_at_least_a_size_is_rounded_up():
    from pl_lowprec.memory.sizes import format_bytes_at_least

    sizes = [1023, 2**30 + 2**20, 2**30 - 1, 5 * 2**20 + 1]
    assert [format_bytes_at_least(n) for n in sizes] == ["1023 bytes", "1.01 GiB", "1024.00 MiB", "5.01 MiB"]


def test_a_bad_budget_is_refused_when_the_strategy_is_built():
    with pytest.raises(ValueError, match=r"memory_budget='lots' is not a memory size: .*24GiB, 80GB or 512MiB"):
        LowPrecisionStrategy(memory_budget="lots")


def test_meta_copy_copies_no_weight():
    model = tiny_llama(hidden_size=64)
    copy = meta_copy(model)
    assert all(p.is_meta for p in copy.parameters()) and not any(p.is_meta for p in model.parameters())
    assert [n for n, _ in copy.named_parameters()] == [n for n, _ in model.named_parameters()]
    assert [p.requires_grad for p in copy.parameters()] == [p.requires_grad for p in model.parameters()]


def test_under_lowprec_fsdp_on_two_ranks_the_budget_is_per_rank(tmp_path):
    """``pl-lowprec fit`` of the shipped FSDP config on 2 gloo ranks, started as torchrun starts them (Lightning's
    own launcher runs the same config in test_configs.py): rank 0 predicts the per-rank peak inside the running
    process group and sends its choice to rank 1 (``rank_zero_search.py``), and the run goes on. The config's
    "auto" settings are chosen for the budget, which the choice's line says."""
    command = [
        *(sys.executable, str(ROOT / "pl_lowprec" / "__main__.py"), "fit"),
        *("--config", str(ROOT / "configs" / "fsdp-qlora.yaml")),
        *("--trainer.max_steps", "1", "--trainer.limit_val_batches", "0", "--trainer.logger", "false"),
        *("--trainer.default_root_dir", str(tmp_path)),  # its last.ckpt lands there
        *("--trainer.strategy.init_args.memory_budget", "1GiB"),
    ]
    done = warm_python.run(command, timeout=600, cwd=tmp_path, ranks=2)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Memory settings for 1.00 GiB (memory_budget=1.00 GiB): no activation checkpointing" in done.stderr
    choice = r"; predicted peak [\d.]+ [KMG]iB per rank, [\d.]+ s per step on this CPU .*; the fastest settings"
    assert re.search(choice, done.stderr), done.stderr[-3000:]
    assert "`Trainer.fit` stopped: `max_steps=1` reached." in done.stdout + done.stderr
