"""--ckpt_path on the user's path (CausalLM + TextDataModule through the CLI): a checkpoint that is missing, not a
checkpoint, or another run's stops the command before anything loads, unless the user says otherwise."""

import re

import pytest
import torch
from loading_helpers import causal_lm_fit_args, save_pretrained_dir, write_prompt_completion

from pl_lowprec.callbacks import StepBoundaryCheckpoint
from pl_lowprec.cli import build_cli, main

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A 2-step run of CausalLM on prompt/completion records, with ModelCheckpoint(save_last=True)."""
    tmp = tmp_path_factory.mktemp("resume")
    pretrained = save_pretrained_dir(tmp / "pretrained")
    args = [
        *causal_lm_fit_args(pretrained, write_prompt_completion(tmp / "pc.jsonl")),
        "--trainer.callbacks+=ModelCheckpoint",
        "--trainer.callbacks.save_last=true",
    ]
    root = tmp / "runs"
    main([*args, f"--trainer.default_root_dir={root}", "--trainer.max_steps=2"])
    return args, root, root / "lightning_logs/version_0/checkpoints/last.ckpt"


def snapshot(directory):
    return {p: p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


def refusal(capsys, args) -> str:
    """pl-lowprec stops: exit status 2 and one paragraph on stderr, no traceback."""
    with pytest.raises(SystemExit) as exit_info:
        main(args)
    assert exit_info.value.code == 2
    message = capsys.readouterr().err
    assert "Traceback" not in message and message.startswith("error: ") and message.count("\n") == 1, message
    return message


def test_last_resumes_the_newest_run_and_logs_beside_it_leaving_its_files_as_they_were(run, tmp_path):
    """As Lightning numbers every fit: the resumed run logs to a new version_N (a run that saved nothing, killed
    early, is skipped over by ``last``), and the earlier run's metrics.csv rows, config.yaml, hparams.yaml and
    checkpoints stay byte for byte; the step count goes on from the checkpoint's."""
    args, _, _ = run
    root = [f"--trainer.default_root_dir={tmp_path}", "--trainer.log_every_n_steps=1"]
    main([*args, *root, "--trainer.max_steps=2"])
    logs = tmp_path / "lightning_logs"
    (logs / "version_1").mkdir()  # a later run that saved nothing (killed early)
    earlier = snapshot(logs / "version_0")
    rows = (logs / "version_0/metrics.csv").read_text().splitlines()
    assert [line.split(",")[1] for line in rows[1:]] == ["0", "1"]  # epoch,step,train/loss: steps 0 and 1
    cli = build_cli([*args, *root, "--ckpt_path=last", "--trainer.max_steps=4"])
    last = logs / "version_0/checkpoints/last.ckpt"
    assert cli.trainer.ckpt_path == str(last) and cli.trainer.global_step == 4  # went on from step 2
    assert (
        type(cli.trainer.checkpoint_callback) is StepBoundaryCheckpoint
    )  # Lightning's class, named on the command line
    assert snapshot(logs / "version_0") == earlier  # nothing of the earlier run rewritten
    resumed = logs / "version_2"
    assert cli.trainer.log_dir == str(resumed)
    assert [line.split(",")[1] for line in (resumed / "metrics.csv").read_text().splitlines()[1:]] == ["2", "3"]
    assert (resumed / "config.yaml").is_file()
    assert torch.load(resumed / "checkpoints/last.ckpt", weights_only=True)["global_step"] == 4
    cli = build_cli([*args, *root, "--ckpt_path=last", "--trainer.max_steps=5"])  # the newest last.ckpt now
    assert cli.trainer.ckpt_path == str(resumed / "checkpoints/last.ckpt") and cli.trainer.global_step == 5


def test_last_that_finds_nothing_stops_and_names_where_it_looked(run, tmp_path, capsys):
    args = run[0]
    message = refusal(capsys, [*args, f"--trainer.default_root_dir={tmp_path}", "--ckpt_path=last"])
    assert "found no last checkpoint in '" + str(tmp_path / "lightning_logs/version_0/checkpoints") + "'" in message
    assert "--allow_fresh_start true" in message
    assert "save_last" not in message  # this config writes a last.ckpt
    assert not any(tmp_path.iterdir())  # nothing trained, nothing written


def test_last_without_save_last_names_the_checkpoints_there_and_why_none_is_last(run, tmp_path, capsys):
    """Lightning's default ModelCheckpoint writes ``epoch=E-step=S.ckpt`` and no last.ckpt, so ``last`` can never
    find a run of such a config: the refusal names the files there and the setting."""
    args, _, last = run
    without_save_last = [a for a in args if "ModelCheckpoint" not in a and "save_last" not in a]
    saved = tmp_path / "lightning_logs/version_0/checkpoints/epoch=0-step=2.ckpt"
    saved.parent.mkdir(parents=True)
    saved.write_bytes(last.read_bytes())
    message = refusal(capsys, [*without_save_last, f"--trainer.default_root_dir={tmp_path}", "--ckpt_path=last"])
    assert f"The newest checkpoints under {tmp_path}: {saved}; pass one as --ckpt_path to resume it." in message
    assert "No checkpoint callback of this config sets save_last" in message


def test_allow_fresh_start_trains_from_scratch_when_nothing_is_found(run, tmp_path):
    args, _, _ = run
    fresh = [f"--trainer.default_root_dir={tmp_path}", "--ckpt_path=last", "--allow_fresh_start=true"]
    cli = build_cli([*args, *fresh, "--trainer.max_steps=1"])
    assert cli.trainer.ckpt_path is None and cli.trainer.global_step == 1


def test_a_missing_or_non_checkpoint_path_is_refused(run, tmp_path, capsys):
    args, _, _ = run
    message = refusal(
        capsys, [*args, f"--trainer.default_root_dir={tmp_path}", f"--ckpt_path={tmp_path / 'missing.ckpt'}"]
    )
    assert re.search(r"--ckpt_path '.*missing.ckpt' does not exist.*--allow_fresh_start", message)
    text = tmp_path / "notes.ckpt"
    text.write_text("hello")
    message = refusal(capsys, [*args, f"--trainer.default_root_dir={tmp_path}", f"--ckpt_path={text}"])
    assert re.search(r"'.*notes.ckpt' is not a Lightning checkpoint \(not a torch.save archive", message)


@pytest.mark.parametrize("subcommand", ["validate", "test", "predict"])
def test_an_evaluation_without_its_checkpoint_says_what_it_would_use_instead(run, tmp_path, capsys, subcommand):
    """Not "nothing to resume" with --allow_fresh_start: without the weights it would score the untrained model."""
    args = [subcommand, *run[0][1:], f"--trainer.default_root_dir={tmp_path}"]
    message = refusal(capsys, [*args, f"--ckpt_path={tmp_path / 'missing.ckpt'}"])
    assert f"so {subcommand} has no trained weights to use" in message and "resume" not in message
    assert f"leave out --ckpt_path to {subcommand} the model the config builds, untrained" in message
    message = refusal(capsys, [*args, "--ckpt_path=last"])
    assert f"found no last checkpoint in '{tmp_path}" in message and "--allow_fresh_start" not in message
    assert f"Lightning would {subcommand} the model the config builds, untrained" in message


@pytest.mark.parametrize(("subcommand", "missing"), [("test", "test_step()"), ("predict", "predict_dataloader")])
def test_test_and_predict_on_causal_lm_name_the_commands_that_score_and_complete(
    run, tmp_path, capsys, subcommand, missing
):
    """CausalLM has no test_step and TextDataModule no predict loader: Lightning's refusal, not a possible bug (no
    traceback hint), with validate and generate named."""
    args, _, last = run
    message = refusal(capsys, [subcommand, *args[1:], f"--trainer.default_root_dir={tmp_path}", f"--ckpt_path={last}"])
    assert f"{subcommand} stopped before its first step: " in message and missing in message
    assert "run the same command as `pl-lowprec validate` (the same --config and --ckpt_path;" in message
    assert "pl-lowprec generate" in message and "PL_LOWPREC_DEBUG" not in message
    if subcommand == "test":  # the advice, followed, scores the checkpoint
        data = next(a for a in args if a.startswith("--data.train_files=")).split("=", 1)[1]
        scored = [f"--data.val_files={data}", "--trainer.limit_val_batches=1", f"--ckpt_path={last}"]
        cli = build_cli(["validate", *args[1:], f"--trainer.default_root_dir={tmp_path}", *scored])
        assert "val/loss" in cli.trainer.callback_metrics  # other files than it trained on: no refusal


def test_another_runs_checkpoint_is_refused_naming_what_differs(run, tmp_path, capsys):
    args, _, last = run
    other = [*args, f"--trainer.default_root_dir={tmp_path}", f"--ckpt_path={last}", "--trainer.max_steps=3"]
    message = refusal(capsys, [*other, "--model.lr=0.01", "--data.batch_size=2"])
    assert "model.lr: checkpoint 0.0002, config 0.01; data.batch_size: checkpoint 4, config 2" in message
    assert "--allow_changed_hparams true" in message
    assert not any(tmp_path.iterdir())  # stopped before the Trainer wrote anything

    # asked for: the config's value is the one used (LightningCLI alone would take the checkpoint's None)
    cli = build_cli([*other, "--model.loss_chunk_size=8", "--allow_changed_hparams=true"])
    assert cli.model.hparams.loss_chunk_size == 8 and cli.trainer.global_step == 3


def test_the_same_run_resumes_where_it_stopped(run, tmp_path):
    args, _, last = run
    cli = build_cli([*args, f"--trainer.default_root_dir={tmp_path}", f"--ckpt_path={last}", "--trainer.max_steps=3"])
    assert cli.trainer.global_step == 3
    saved = torch.load(last, weights_only=True)
    assert saved["datamodule_hyper_parameters"]["batch_size"] == 4  # what the check compares against


def test_a_finished_run_resumed_with_the_same_max_steps_says_it_has_nothing_to_train(run, tmp_path, caplog):
    """Lightning restores it and stops at once, which reads like a failed resume; not a refusal, since a job that
    resumes itself may start again after it finished."""
    args, _, last = run
    with caplog.at_level("INFO"):
        cli = build_cli(
            [*args, f"--trainer.default_root_dir={tmp_path}", f"--ckpt_path={last}", "--trainer.max_steps=2"]
        )
    assert cli.trainer.global_step == 2
    assert f"--ckpt_path '{last}' is at step 2, and trainer.max_steps is 2: this run is finished" in caplog.text
    assert "raise it (--trainer.max_steps 4)" in caplog.text
    caplog.clear()
    with caplog.at_level("INFO"):
        build_cli([*args, f"--trainer.default_root_dir={tmp_path}", f"--ckpt_path={last}", "--trainer.max_steps=3"])
    assert "this run is finished" not in caplog.text


def test_resuming_with_another_optimizer_than_the_checkpoints_is_refused_before_its_first_step(run, tmp_path, capsys):
    """The run printed "Restored all states" and failed in its first step with KeyError: 'exp_avg' (bitsandbytes'
    state into torch's AdamW) or 'state1' (the other way)."""
    pytest.importorskip("bitsandbytes")
    args, _, _ = run
    strategy = [
        "--trainer.strategy=pl_lowprec.LowPrecisionStrategy",
        "--trainer.strategy.lora={r: 4, lora_alpha: 8}",
        "--trainer.strategy.optimizer=adamw8bit",
    ]
    main([*args, *strategy, f"--trainer.default_root_dir={tmp_path / 'a'}", "--trainer.max_steps=2"])
    last = tmp_path / "a/lightning_logs/version_0/checkpoints/last.ckpt"
    record = torch.load(last, weights_only=False)["pl_lowprec_optimizers"]
    assert record == {"classes": ["bitsandbytes.optim.adamw.AdamW8bit"], "optimizer": "adamw8bit"}
    resume = [*args, *strategy, f"--trainer.default_root_dir={tmp_path / 'b'}", f"--ckpt_path={last}"]
    message = refusal(capsys, [*resume, "--trainer.max_steps=3", "--trainer.strategy.optimizer=null"])
    assert (
        "fit stopped before its first step: The checkpoint's optimizer state is bitsandbytes.optim.adamw.AdamW8bit's"
        " (optimizer='adamw8bit'), and this run steps torch.optim.adamw.AdamW (optimizer=None): their states differ"
    ) in message
    assert "Resume with the optimizer the checkpoint trained with (optimizer='adamw8bit')" in message
    assert "optimizer='lion8bit'" in refusal(
        capsys, [*resume, "--trainer.max_steps=3", "--trainer.strategy.optimizer=lion8bit"]
    )
    cli = build_cli([*resume, "--trainer.max_steps=3"])  # the same optimizer resumes
    assert cli.trainer.global_step == 3
    saved = torch.load(last, weights_only=False)
    del saved["pl_lowprec_optimizers"]  # a checkpoint of an earlier version: its state's layout tells
    torch.save(saved, tmp_path / "unrecorded.ckpt")
    older = [
        *args,
        *strategy,
        f"--trainer.default_root_dir={tmp_path / 'c'}",
        f"--ckpt_path={tmp_path / 'unrecorded.ckpt'}",
    ]
    message = refusal(capsys, [*older, "--trainer.max_steps=3", "--trainer.strategy.optimizer=null"])
    assert "The checkpoint's optimizer state is a bitsandbytes optimizer's, and this run steps torch.optim" in message
