"""estimate and plan read configs exactly as fit does: several ``--config`` files merge, in order with the
overrides, and an overlay that sets one value works (both used to take the last file alone)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml
from estimate_memo_helpers import estimates_once

from pl_lowprec.cli import estimate as estimate_cli_module
from pl_lowprec.cli import main
from pl_lowprec.memory import fastest

pytest.importorskip("peft")
pytest.importorskip("bitsandbytes")

QUICKSTART = str(Path(__file__).resolve().parents[2] / "configs/quickstart.yaml")
OVERLAY = {"data": {"init_args": {"batch_size": 2}}, "trainer": {"strategy": {"init_args": {"lora": {"r": 4}}}}}


def table(capsys, *args: str) -> str:
    """The estimate's table, without the seconds it took."""
    main(["estimate", *args])
    return re.sub(r"estimated in [0-9.]+ s", "", capsys.readouterr().out)


@pytest.fixture
def simulated_once(monkeypatch):
    """The tests below compare the estimates of one config given several ways: each distinct estimate is
    simulated once (the arguments and the model compared by value), so equal tables mean equal arguments."""
    return estimates_once(monkeypatch, estimate_cli_module, fastest, by_model=True)


@pytest.fixture
def overlay(tmp_path):
    path = tmp_path / "overlay.yaml"
    path.write_text(yaml.safe_dump(OVERLAY))
    return path


def test_estimate_of_several_configs_is_the_estimate_of_the_config_fit_merges(
    tmp_path, capsys, overlay, simulated_once
):
    with pytest.raises(SystemExit) as printed:
        main(["fit", f"--config={QUICKSTART}", f"--config={overlay}", "--print_config"])
    assert printed.value.code == 0
    merged = tmp_path / "merged.yaml"
    merged.write_text(capsys.readouterr().out)  # what fit runs
    assert yaml.safe_load(merged.read_text())["data"]["init_args"]["batch_size"] == 2

    both = table(capsys, "--config", QUICKSTART, "--config", str(overlay))
    assert both == table(capsys, "--config", str(merged))
    overrides = ["--data.init_args.batch_size=2", "--trainer.strategy.init_args.lora.r=4"]
    assert both == table(capsys, "--config", QUICKSTART, *overrides)
    alone = table(capsys, "--config", QUICKSTART)
    assert alone != both  # the overlay counts: a smaller batch, a smaller rank
    assert alone.startswith("Batch: 8 rows x 128 positions, the longest batch the training data makes.\n")
    assert both.startswith("Batch: 2 rows x 128 positions,")
    assert int(re.search(r"(\d[\d,]*) trainable", alone)[1].replace(",", "")) > int(
        re.search(r"(\d[\d,]*) trainable", both)[1].replace(",", "")
    )
    # in order, as for fit: a later --config overrides an earlier override
    assert table(capsys, "--config", QUICKSTART, *overrides, "--config", QUICKSTART) == alone
    # each with the faster settings' line: both and merged ask alike, and alone and the last; the dotted override
    # keeps the quick-start's lora_alpha, which the overlay's lora mapping replaces (jsonargparse, as in fit)
    assert len(simulated_once) == 3 * 2


def test_plan_writes_the_configs_merged_and_runs_them(tmp_path, capsys, overlay):
    out = tmp_path / "plan.yaml"
    main(["plan", f"--config={QUICKSTART}", f"--config={overlay}", "--memory=64MiB", f"--out={out}"])
    printed = capsys.readouterr().out
    assert f"Wrote {out}" in printed
    # a budget under 1 GiB in MiB: the quick-start's peaks of a few MiB read 0.004 GiB in a GiB table
    assert "Budget 64.00 MiB, margin 10%: a peak up to 57.60 MiB fits." in printed
    chosen = re.search(r"^\* yes +(?P<peak>[0-9.]+) +(?P<headroom>[0-9.]+) ", printed, re.MULTILINE)
    assert 1.0 < float(chosen["peak"]) < 57.6 and float(chosen["headroom"]) == pytest.approx(
        57.6 - float(chosen["peak"]), abs=0.002
    )
    text = out.read_text()
    assert text.startswith(f"# Written by pl-lowprec plan from {QUICKSTART} + {overlay}:")
    planned = yaml.safe_load(text)
    assert planned["trainer"]["strategy"]["init_args"]["lora"]["r"] == 4  # the overlay's
    assert planned["trainer"]["strategy"]["init_args"]["quantization"] == "nf4-dq"  # the first file's
    assert planned["data"]["init_args"]["batch_size"] * planned["trainer"]["accumulate_grad_batches"] == 2
    assert table(capsys, "--config", str(out))  # the written file is a whole config


def test_a_config_without_devices_is_estimated_as_lightning_resolves_auto(capsys, simulated_once):
    """Lightning's default ``devices="auto"`` (the quick-start without its ``devices: 1``) was refused as if the
    single-device config were sharded."""
    assert table(capsys, "--config", QUICKSTART, "--trainer.devices=auto") == table(capsys, "--config", QUICKSTART)
    assert len(simulated_once) == 2  # the estimate and the faster settings' line, asked alike both times


def test_the_ranks_of_a_config_resolve_auto_where_lightning_would_and_refuse_an_unknown_count(monkeypatch):
    from types import SimpleNamespace

    from pl_lowprec import LowPrecisionStrategy
    from pl_lowprec.cli.estimate import devices_of

    def ranks(strategy, devices, accelerator="cpu", num_nodes=1):
        trainer = SimpleNamespace(strategy=strategy, devices=devices, accelerator=accelerator, num_nodes=num_nodes)
        return devices_of(trainer)

    assert ranks(LowPrecisionStrategy(), "auto", accelerator="cuda") == 1  # one device, whatever the machine
    assert ranks("lowprec", -1, accelerator="cuda") == 1
    assert ranks("lowprec_fsdp", "auto") == 1  # one CPU process, as Lightning runs devices="auto" on a CPU
    assert (ranks("lowprec_ddp", [0, 1]), ranks("lowprec_ddp", "2"), ranks("lowprec_ddp", 2, num_nodes=2)) == (2, 2, 4)
    monkeypatch.setattr("torch.cuda.is_available", lambda: True)
    monkeypatch.setattr("torch.cuda.device_count", lambda: 8)
    assert ranks("lowprec_fsdp", "auto", accelerator="cuda") == 8  # every GPU there is
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    with pytest.raises(ValueError, match=r"trainer.devices='auto' on CUDA, .* --trainer.devices=2"):
        ranks("lowprec_ddp", "auto", accelerator="cuda")


def test_estimate_checks_the_data_tokenizer_as_fit_does_and_says_when_it_is_not_the_models(tmp_path, capsys):
    """A shapes-only directory (config.json) with some other tokenizer: the batch lengths follow that tokenizer,
    which the estimate says; another model's tokenizer beside a model that has its own is refused, as in fit."""
    import json

    from loading_helpers import save_pretrained_dir, save_tokenizer, write_prompt_completion
    from model_shapes import SMOLLM2_135M

    shapes = tmp_path / "smollm2"
    shapes.mkdir()
    (shapes / "config.json").write_text(json.dumps({**SMOLLM2_135M, "num_hidden_layers": 2}))
    tokenizer, data = save_tokenizer(tmp_path / "tokenizer"), write_prompt_completion(tmp_path / "pc.jsonl")
    finetune = [f"--config={Path(QUICKSTART).parent / 'finetune-causal-lm.yaml'}", f"--data.train_files={data}"]
    finetune += ["--data.val_files=null", "--trainer.val_check_interval=1.0"]
    said = table(capsys, *finetune, f"--model.pretrained={shapes}", f"--data.tokenizer={tokenizer}")
    assert "Tokenizer: 320 tokens for a model of vocab_size 49,152, so not the model's own" in said

    own = save_pretrained_dir(tmp_path / "own")  # its own tokenizer: nothing to say
    assert "Tokenizer:" not in table(capsys, *finetune, f"--model.pretrained={own}", f"--data.tokenizer={own}")
    from pl_lowprec.demo.stdlib_text import stdlib_bytes
    from pl_lowprec.demo.tokenizer import train_tokenizer

    other = tmp_path / "other"  # as large, other merges: the ids name other tokens
    train_tokenizer([stdlib_bytes(100_000).decode("utf-8", "replace")[::-1]], 320).save_pretrained(other)
    with pytest.raises(SystemExit):
        main(["estimate", *finetune, f"--model.pretrained={own}", f"--data.tokenizer={other}"])
    assert "is not the tokenizer saved with the model" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("strategy", "named", "hint"),
    [
        ("nonsense_strategy", "'nonsense_strategy'", False),
        ("pl_lowprec.LowPrecisionFSDPStrategy", "'pl_lowprec.lowprecisionfsdpstrategy'", True),
    ],
)
def test_estimate_refuses_a_strategy_name_fit_refuses(capsys, strategy, named, hint):
    """A strategy string nobody registered (a typo, or a class path given as an override, which jsonargparse keeps
    as a string) is refused in fit's paragraph, not estimated as an unquantized run without LoRA (audit 64b #9)."""
    with pytest.raises(SystemExit) as refused:
        main(["estimate", f"--config={QUICKSTART}", f"--trainer.strategy={strategy}"])
    assert refused.value.code == 2
    error = capsys.readouterr().err
    assert f"invalid strategy name: `strategy={named}`" in error
    assert "pl_lowprec's names: lowprec, lowprec_ddp" in error  # the fix: a registered name
    assert ("trainer.strategy.class_path" in error) is hint
    assert "PEAK" not in capsys.readouterr().out


def peak_line(capsys, *args: str) -> str:
    main(["estimate", "--config", QUICKSTART, *args])
    line = next(line for line in capsys.readouterr().out.splitlines() if "PEAK" in line)
    return re.sub(r"estimated in [0-9.]+ s", "", line)


@pytest.mark.filterwarnings("ignore:`precision=.*is supported for historical reasons")
def test_trainer_precision_bf16_is_estimated_as_the_bf16_mixed_that_fit_runs(capsys, simulated_once):
    """Lightning runs ``precision: bf16`` as bf16-mixed; the estimate took it for fp32 (+65%, audit 64b #1)."""
    plain = ("--trainer.plugins=null", "--trainer.strategy.init_args.memory_saving=true")
    alias = peak_line(capsys, *plain, "--trainer.precision=bf16")
    assert alias == peak_line(capsys, *plain, "--trainer.precision=bf16-mixed")
    assert alias != peak_line(capsys, *plain, "--trainer.precision=32-true")
    assert len(simulated_once) == 2 * 2  # bf16 asked as bf16-mixed is, and 32-true (each with the faster line)
