"""The fastest settings that fit (``memory_saving="auto"``, ``activation_checkpointing="auto"``): a budget the fast
path fits turns nothing on, smaller ones turn the savings on in order, each choice's estimate fits, explicit
settings are kept, and where the device is not known the estimate stays on the memory-saving side."""

import functools
import re
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from qlora_helpers import tiny_llama

from pl_lowprec import estimate_memory
from pl_lowprec.cli.estimate import main as estimate_main
from pl_lowprec.memory.estimate import MemoryEstimate
from pl_lowprec.memory.fastest import MARGIN, faster_settings_line, fastest_fitting, ladder, search_ladder
from pl_lowprec.transforms.config import TransformConfig

pytest.importorskip("peft")
BATCH = {"input_ids": torch.randint(0, 256, (4, 64), generator=torch.Generator().manual_seed(0))}
LORA = {"r": 4, "lora_alpha": 8}
AUTO = {"memory_saving": "auto", "activation_checkpointing": "auto"}
build = functools.partial(tiny_llama, hidden_size=64)
_QUICKSTART = Path(__file__).resolve().parents[2] / "configs" / "quickstart.yaml"


def _search(limit, **config):
    return fastest_fitting(build, BATCH, limit, "bf16-mixed", "cpu", TransformConfig(lora=LORA, **config))


@pytest.fixture(scope="module")
def every_candidate():
    """Each candidate of the ladder simulated (a limit nothing fits), fastest first."""
    search = _search(0, **AUTO)
    assert not search.fits and len(search.tried) == search.candidates == 5
    return search.tried


def test_a_budget_the_fast_path_fits_turns_nothing_on(every_candidate):
    fastest_peak = every_candidate[0][2].peak
    search = _search(fastest_peak, **AUTO)
    assert len(search.tried) == 1 and search.fits  # a device with room costs one estimate
    assert search.config.memory_saving == frozenset() and search.config.activation_checkpointing is None
    assert search.settings.describe() == "no activation checkpointing, MLP unfused, norms with their own backward"
    assert search.estimate.peak == fastest_peak


def test_smaller_budgets_turn_the_savings_on_in_order_and_each_choice_fits(every_candidate):
    peaks = [estimate.peak for _, _, estimate in every_candidate]
    assert peaks == sorted(peaks, reverse=True)  # this model: each rung saves memory
    described = [settings.describe() for settings, _, _ in every_candidate]
    assert described == [
        "no activation checkpointing, MLP unfused, norms with their own backward",
        "no activation checkpointing, fused LoRA MLP, norms recomputed row-wise",
        "selective activation checkpointing, norms recomputed row-wise",  # selective keeps the MLP unfused
        "activation checkpointing on every 2nd block, fused LoRA MLP, norms recomputed row-wise",
        "activation checkpointing on every block, fused LoRA MLP, norms recomputed row-wise",
    ]
    # Which rung each budget chooses: the search over the estimates simulated above (each simulated step is
    # deterministic), then one budget searched end to end, and each rung's config estimated on its own.
    auto = TransformConfig(lora=LORA, **AUTO)
    order, blocks = ladder(build, "bf16-mixed", torch.device("cpu"), auto)
    for index, peak in enumerate(peaks):
        for budget in (peak, (peak + peaks[index - 1]) // 2) if index else (peak,):
            search = search_ladder(order, blocks, auto, budget, _replaying(every_candidate))
            assert len(search.tried) == index + 1 and search.fits, (budget, index)  # the first that fits
            assert search.config == every_candidate[index][1]
    for _, config, simulated_estimate in every_candidate:  # the chosen config's own estimate fits
        assert estimate_memory(build, BATCH, precision="bf16-mixed", config=config).peak == simulated_estimate.peak
    between = _search((peaks[2] + peaks[1]) // 2, **AUTO)
    assert len(between.tried) == 3 and between.fits and between.estimate.peak == peaks[2]
    config = every_candidate[-1][1]
    assert config.activation_checkpointing == ["LlamaDecoderLayer"] and config.checkpoint_every_n == 1


def _replaying(tried: list) -> Callable[..., MemoryEstimate]:
    """``search_ladder``'s ``simulate``, answering from the steps ``tried`` simulated for the same configs."""
    return lambda config: next(estimate for _, candidate, estimate in tried if candidate == config)


def test_explicit_settings_are_kept_and_only_the_auto_ones_vary():
    off = _search(0, memory_saving=False, activation_checkpointing="auto")
    assert [s.describe() for s, _, _ in off.tried] == [
        "no activation checkpointing, MLP unfused, norms with their own backward",
        "selective activation checkpointing, norms with their own backward",
        "activation checkpointing on every 2nd block, MLP unfused, norms with their own backward",
        "activation checkpointing on every block, MLP unfused, norms with their own backward",
    ]
    assert {c.memory_saving for _, c, _ in off.tried} == {frozenset()}
    named = _search(0, memory_saving="auto", activation_checkpointing=["LlamaDecoderLayer"], checkpoint_every_n=2)
    assert [s.describe() for s, _, _ in named.tried] == [
        "MLP unfused, norms with their own backward",
        "fused LoRA MLP, norms recomputed row-wise",
    ]
    kept = {(c.activation_checkpointing[0], c.checkpoint_every_n) for _, c, _ in named.tried}
    assert kept == {("LlamaDecoderLayer", 2)}
    only_norms = _search(0, memory_saving=["recomputed_norms"], activation_checkpointing="auto")
    assert {c.memory_saving for _, c, _ in only_norms.tried} == {frozenset({"recomputed_norms"})}


def test_reentrant_checkpointing_is_kept_and_selective_left_out_of_the_search():
    """``checkpoint_impl="reentrant"`` is the user's: selective checkpointing runs non-reentrant only, so the search
    leaves it out rather than stopping the run on a ``checkpoint_mode`` the user never set (audit 64b #6)."""
    search = _search(0, checkpoint_impl="reentrant", **AUTO)  # nothing fits: every candidate is simulated
    assert [s.checkpointing for s, _, _ in search.tried][-2:] == ["every 2nd block", "every block"]
    assert "selective" not in {s.checkpointing for s, _, _ in search.tried}
    assert {(c.checkpoint_impl, c.checkpoint_mode) for _, c, _ in search.tried} == {("reentrant", "full")}
    fitting = _search(search.tried[-2][2].peak, checkpoint_impl="reentrant", **AUTO)
    assert fitting.fits and fitting.settings.checkpointing == "every 2nd block"


def test_where_nothing_chooses_auto_is_the_memory_saving_side():
    """``estimate_memory`` of a config with "auto" gives what the same config gave before "auto": every path on,
    every declared block checkpointed."""
    blocks = ["LlamaDecoderLayer"]
    saving = estimate_memory(build, BATCH, precision="bf16-mixed", lora=LORA, activation_checkpointing=blocks)
    auto = estimate_memory(build, BATCH, precision="bf16-mixed", lora=LORA, **AUTO)
    assert auto.as_dict() == saving.as_dict() and auto.peak_split == saving.peak_split
    plain = estimate_memory(build, BATCH, precision="bf16-mixed", lora=LORA, memory_saving=False)
    assert plain.peak > estimate_memory(build, BATCH, precision="bf16-mixed", lora=LORA).peak  # the switch works


def test_the_faster_settings_line_simulates_nothing_where_there_is_nothing_to_choose(monkeypatch):
    """Explicit settings leave one candidate: no line, and no simulated step spent finding that out."""
    simulated = []
    real = fastest_fitting.__globals__["estimate_memory"]
    monkeypatch.setitem(
        fastest_fitting.__globals__, "estimate_memory", lambda *a, **k: simulated.append(1) or real(*a, **k)
    )
    explicit = TransformConfig(lora=LORA, memory_saving=False, activation_checkpointing=None)
    assert faster_settings_line(build, BATCH, "bf16-mixed", "cpu", config=explicit) is None
    assert simulated == []
    line = faster_settings_line(build, BATCH, "bf16-mixed", "cpu", config=TransformConfig(lora=LORA, **AUTO))
    assert line.startswith("On a device with at least ") and simulated == [1]  # the fastest candidate only


def test_bad_values_are_refused_with_what_is_allowed():
    with pytest.raises(ValueError, match=r"memory_saving='fast' is not valid: use 'auto' .* fused_mlp, recomputed_"):
        TransformConfig(memory_saving="fast")
    with pytest.raises(ValueError, match=r"memory_saving='fused_mpl' is not valid"):
        TransformConfig(memory_saving=["fused_mlp", "fused_mpl"])
    with pytest.raises(ValueError, match=r"activation_checkpointing='auto' with checkpoint_every_n=2 .* chooses"):
        TransformConfig(activation_checkpointing="auto", checkpoint_every_n=2)


def test_the_cli_estimate_reports_the_memory_saving_side_and_the_faster_settings(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["pl-lowprec"])
    estimate_main(["--config", str(_QUICKSTART), "--trainer.max_steps", "1"])
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert lines[0].startswith("Batch: ") and lines[1].startswith("Estimated training memory (")
    line = lines[-1]
    found = re.fullmatch(
        r"On a device with at least ([0-9.]+) MiB free, fit would take the fastest settings \((.*)\): predicted peak"
        r" ([0-9.]+) MiB\. Above: the memory-saving settings \('auto' where the device is not known\)\.",
        line,
    )
    assert found, line
    assert found.group(2) == "no activation checkpointing, MLP unfused, norms with their own backward"
    shown = float(re.search(r"PEAK ([0-9,.]+) MiB", out).group(1).replace(",", ""))
    fastest = float(found.group(3))
    assert fastest > shown  # the table is the memory-saving side
    assert float(found.group(1)) >= fastest / (1 - MARGIN)  # in the peak's unit, rounded up
    assert float(found.group(1)) == pytest.approx(fastest / (1 - MARGIN), abs=0.011)
    assert "compile" not in out
    estimate_main(
        ["--config", str(_QUICKSTART), "--trainer.max_steps", "1", "--trainer.strategy.init_args.compile", "true"]
    )
    assert "With compile=, checkpointed blocks' compiled backward is added" in capsys.readouterr().out


def test_with_compile_the_line_says_how_the_compiled_peak_is_predicted(every_candidate):
    """Blocks compiled without checkpointing are predicted as eager ones; the line says how compiled blocks are
    predicted, only under compile=."""
    fastest_peak = every_candidate[0][2].peak
    eager, compiled = _search(fastest_peak, **AUTO), _search(fastest_peak, **AUTO, compile=True)
    assert compiled.estimate.peak == eager.estimate.peak  # the same eager step is simulated
    assert "blocks compiled without checkpointing are predicted as eager ones" in compiled.line("test")
    assert "compile" not in eager.line("test")
