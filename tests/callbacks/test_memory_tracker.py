"""MemoryTracker: each figure equals an independent count; per-stage entries; activation drop with checkpointing."""

import json

import pytest
import torch
from lightning.pytorch.loggers import CSVLogger
from lightning_helpers import Classifier, quiet_trainer
from plain_amp_loop import make_classification_data, make_mlp

from pl_lowprec import LowPrecisionStrategy, MemoryTracker
from pl_lowprec.callbacks.memory_tracker import format_table
from pl_lowprec.demo.tiny_gpt import TinyGPT


def _loader(n=64):
    return torch.utils.data.DataLoader(make_classification_data(n=n), batch_size=8)


def test_breakdown_equals_independent_counts(tmp_path, capsys):
    model = make_mlp()
    model[0].requires_grad_(False)  # frozen weights: no gradient, no Adam state
    tracker = MemoryTracker()
    trainer = quiet_trainer(max_steps=3, callbacks=[tracker], logger=CSVLogger(tmp_path))
    trainer.fit(Classifier(model), _loader())

    figures = tracker.summary["fit"]["bytes"]
    all_bytes = sum(p.numel() * 4 for p in model.parameters())
    trainable = [p for p in model.parameters() if p.requires_grad]
    trainable_bytes = sum(p.numel() * 4 for p in trainable)
    assert figures["params_float32"] == all_bytes
    assert figures["gradients"] == trainable_bytes
    # Adam keeps exp_avg and exp_avg_sq (2x the fp32 trainable parameters) plus a 4-byte step per parameter
    assert figures["optimizer_state"] == 2 * trainable_bytes + 4 * len(trainable)
    assert figures["activations"] > 0 and figures["rss_peak"] >= figures["rss_current"] > 0
    assert all(isinstance(v, int) for v in figures.values())

    assert "logged as memory/fit/* to CSVLogger." in capsys.readouterr().out
    on_disk = json.loads((tmp_path / "lightning_logs/version_0/memory_summary.json").read_text())
    assert on_disk == tracker.summary
    with open(tmp_path / "lightning_logs/version_0/metrics.csv") as f:
        assert "memory/fit/optimizer_state" in f.readline()


def test_a_resumed_run_measures_its_own_first_step(tmp_path):
    """Sampling step 0 by default: a run resumed at step 3 never reached it and left activations and gradients
    out of its table."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    def fit(max_steps, ckpt_path=None):
        torch.manual_seed(0)
        tracker = MemoryTracker(print_summary=False)
        checkpoint = ModelCheckpoint(dirpath=tmp_path, save_last=True)
        trainer = quiet_trainer(max_steps=max_steps, callbacks=[tracker, checkpoint], enable_checkpointing=True)
        trainer.fit(Classifier(make_mlp()), _loader(), ckpt_path=ckpt_path)
        return tracker.summary["fit"]["bytes"]

    first = fit(3)
    resumed = fit(5, tmp_path / "last.ckpt")
    assert resumed["activations"] == first["activations"] > 0
    assert resumed["gradients"] == first["gradients"] > 0


def test_figures_are_gathered_on_the_strategy_device(tmp_path, monkeypatch):
    # NCCL gathers only tensors on the GPU, gloo takes CPU ones too: on a CPU run the device of the gathered
    # tensor is checked against a stand-in root device, as it would be a CUDA device under NCCL.
    tracker = MemoryTracker(print_summary=False)
    model = Classifier(make_mlp())
    trainer = quiet_trainer(max_steps=1, callbacks=[tracker], default_root_dir=tmp_path)
    trainer.fit(model, _loader(16))

    gathered_on = []

    def gather_from_ranks(tensor):
        gathered_on.append(tensor.device)
        return torch.zeros(tensor.shape, dtype=tensor.dtype)[None]

    stand_in = torch.device("meta")
    monkeypatch.setattr(type(trainer.strategy), "root_device", property(lambda self: stand_in))
    monkeypatch.setattr("pl_lowprec.callbacks.memory_tracker.gather_from_ranks", gather_from_ranks)
    tracker.on_fit_end(trainer, model)
    assert gathered_on == [stand_in]


def _gpt():
    torch.manual_seed(0)
    return TinyGPT(dim=32, layers=4, heads=2, max_len=64)


def _gpt_loader():
    ids = torch.randint(0, 256, (16, 65), generator=torch.Generator().manual_seed(0))
    return torch.utils.data.DataLoader([{"input_ids": r} for r in ids], batch_size=4)


def test_activation_figure_halves_with_checkpointing(tmp_path):
    plain, checkpointed = MemoryTracker(), MemoryTracker()
    quiet_trainer(max_steps=1, callbacks=[plain], default_root_dir=tmp_path).fit(_gpt(), _gpt_loader())
    strategy = LowPrecisionStrategy(activation_checkpointing="Block")
    quiet_trainer(max_steps=1, callbacks=[checkpointed], strategy=strategy, default_root_dir=tmp_path).fit(
        _gpt(), _gpt_loader()
    )
    before = plain.summary["fit"]["bytes"]["activations"]
    after = checkpointed.summary["fit"]["bytes"]["activations"]
    assert after <= before / 2


def test_reentrant_checkpointing_measures_the_forward_as_the_estimate_does(tmp_path):
    """Reentrant checkpointing recomputes each block in backward without hooks of its own: sampling until after
    backward counted those recomputed saves too (24,000 where the forward held 16,000 in a 4-block model)."""
    from pl_lowprec import estimate_memory

    tracker = MemoryTracker(print_summary=False)
    strategy = LowPrecisionStrategy(activation_checkpointing="Block", checkpoint_impl="reentrant")
    quiet_trainer(max_steps=1, callbacks=[tracker], strategy=strategy, default_root_dir=tmp_path).fit(
        _gpt(), _gpt_loader()
    )
    batch = next(iter(_gpt_loader()))
    estimate = estimate_memory(_gpt, batch, activation_checkpointing="Block", checkpoint_impl="reentrant")
    assert tracker.summary["fit"]["bytes"]["activations"] == estimate.activations > 0


class Hungry(TinyGPT):
    """Holds 256 MiB during each training step, so the fit peak is well above what validation needs."""

    def training_step(self, batch, batch_idx):
        ballast = torch.ones(64 * 2**20)
        loss = super().training_step(batch, batch_idx)
        return loss + 0 * ballast[0]


def test_one_entry_per_stage_with_its_own_peak_and_no_logger(tmp_path, capsys):
    tracker = MemoryTracker()
    torch.manual_seed(0)
    model = Hungry(dim=32, layers=1, heads=2, max_len=64)
    trainer = quiet_trainer(max_steps=2, callbacks=[tracker], default_root_dir=tmp_path, limit_val_batches=1)
    trainer.fit(model, _gpt_loader(), _gpt_loader())
    trainer.validate(model, _gpt_loader())

    assert set(tracker.summary) == {"fit", "validate"}
    fit, validate = tracker.summary["fit"]["bytes"], tracker.summary["validate"]["bytes"]
    assert tracker.summary["fit"]["peak_is_per_stage"]
    assert fit["rss_peak"] - validate["rss_peak"] > 128 * 2**20  # validate's peak was reset, not inherited
    assert "optimizer_state" not in validate
    assert json.loads((tmp_path / "memory_summary.json").read_text()).keys() == {"fit", "validate"}
    printed = capsys.readouterr().out
    assert "Memory, fit (cpu, 1 rank, max across ranks)" in printed and "Memory, validate" in printed
    # where the figures went, said under each table (nothing did; without a logger nothing is logged)
    where = f"Exact bytes in {tmp_path / 'memory_summary.json'}; not logged (the Trainer has no logger)."
    assert printed.count(where) == 2


def test_a_second_run_in_the_same_folder_keeps_the_first_runs_summary(tmp_path):
    """Without a logger both runs write into ``default_root_dir``: the second took the first's file."""
    written, first = [], None
    for _ in range(2):
        trainer = quiet_trainer(max_steps=1, callbacks=[MemoryTracker(print_summary=False)], default_root_dir=tmp_path)
        trainer.fit(TinyGPT(dim=32, layers=1, heads=2, max_len=64), _gpt_loader())
        written.append(sorted(p.name for p in tmp_path.glob("memory_summary*.json")))
        first = first or (tmp_path / "memory_summary.json").read_bytes()
    assert written == [["memory_summary.json"], ["memory_summary-v1.json", "memory_summary.json"]]
    assert (tmp_path / "memory_summary.json").read_bytes() == first


def test_table_shows_min_where_ranks_differ():
    entry = {
        "device": "cuda",
        "world_size": 2,
        "peak_is_per_stage": True,
        "bytes": {"cuda_max_allocated": 3 * 2**20, "gradients": 2**20},
        "min_bytes_across_ranks": {"cuda_max_allocated": 2 * 2**20},
    }
    table = format_table("fit", entry).splitlines()
    assert table[0] == "Memory, fit (cuda, 2 ranks, max across ranks)"
    assert table[2].split() == ["cuda_max_allocated", "3.00", str(3 * 2**20), "2.00"]
    assert table[3].split() == ["gradients", "1.00", str(2**20)]


class HungryWhileBuilt(Classifier):
    """256 MiB held while the model is built (configure_model), as a streaming load or quantization holds
    memory before the first step, and freed before it."""

    def configure_model(self):
        held = torch.ones(64 * 2**20)  # 256 MiB of fp32, touched
        del held


def test_the_fit_peak_includes_building_the_model(tmp_path):
    """The peak was reset in on_fit_start, after configure_model and the strategy's transform: the loading peak of
    a QLoRA run was left out."""
    tracker = MemoryTracker(print_summary=False)
    trainer = quiet_trainer(max_steps=1, callbacks=[tracker], default_root_dir=tmp_path, logger=False)
    trainer.fit(HungryWhileBuilt(make_mlp()), _loader(16))
    fit = tracker.summary["fit"]["bytes"]
    assert tracker.summary["fit"]["peak_is_per_stage"]
    assert fit["rss_peak"] - fit["rss_current"] > 200 * 2**20


def test_two_manual_optimizers_measure_the_first_batch_past_the_sample_step():
    """With two optimizers stepped each batch, global_step is 0, 2, 4 at batch starts: sampling step 1 waited for a
    batch starting at step 1, which never came, and the table had no activations row."""
    from lightning_helpers import TwoOptimizers

    sampled = MemoryTracker(activation_sample_step=1, print_summary=False)
    quiet_trainer(max_steps=6, callbacks=[sampled]).fit(TwoOptimizers(make_mlp()), _loader())
    first = MemoryTracker(print_summary=False)
    quiet_trainer(max_steps=6, callbacks=[first]).fit(TwoOptimizers(make_mlp()), _loader())
    figures = sampled.summary["fit"]["bytes"]
    assert figures["activations"] == first.summary["fit"]["bytes"]["activations"] > 0
    assert figures["gradients"] == sum(p.numel() * 4 for p in make_mlp().parameters())


def test_a_sample_step_the_run_never_reaches_is_said():
    tracker = MemoryTracker(activation_sample_step=100, print_summary=False)
    with pytest.warns(UserWarning, match=r"activation_sample_step=100\): the run ended at optimizer step 2"):
        quiet_trainer(max_steps=2, callbacks=[tracker]).fit(Classifier(make_mlp()), _loader())
    assert "activations" not in tracker.summary["fit"]["bytes"]
