"""Bad values for the documented numeric and Literal arguments stop `pl-lowprec` before any step, with one short
paragraph that names the value: no traceback, no jsonargparse "Union subtypes" dump, exit status 2.

The CLI runs in-process (``pl_lowprec.cli.main``), on the quick-start config (TinyLlama, StdlibTextDataModule)
and on the user's path (``CausalLM`` + ``TextDataModule`` from finetune-causal-lm.yaml on a tiny pretrained
directory). A training step that runs fails the test.
"""

from __future__ import annotations

import json
import shutil
import sys

import pytest
from loading_helpers import save_pretrained_dir, save_with_template

from pl_lowprec.cli import main

pytest.importorskip("bitsandbytes")
pytest.importorskip("peft")

QUICKSTART = "configs/quickstart.yaml"
FINETUNE = "configs/finetune-causal-lm.yaml"
MAX_LINES = 6
FAST = [
    "--trainer.max_steps=1",
    "--trainer.limit_val_batches=1",
    "--trainer.num_sanity_val_steps=0",
    "--trainer.enable_progress_bar=false",
    "--trainer.logger=false",
    "--trainer.accelerator=cpu",
]
STRATEGY = "--trainer.strategy.init_args"
AMP = "--trainer.plugins.init_args"

# (argument, what the message must name). Readability: the package's own message used to be buried in a
# Union dump; literal: an unknown value of a Literal option; numeric: a number outside its range; crash: a
# value that used to fail inside a step or deep in torch/peft.
QUICKSTART_CASES = {
    "typo": [  # a config key mistyped: the key meant, as the package's own subcommands name theirs
        ("--trainer.max-steps=2", "unrecognized arguments: --trainer.max-steps=2: did you mean --trainer.max_steps?"),
        ("--data.batch-size=4", "Option 'batch-size' is not accepted: did you mean --data.batch_size?"),
        (
            f"{STRATEGY}.quantisation=nf4",
            "'quantisation' is not accepted: did you mean --trainer.strategy.quantization?",
        ),
        ("--model.hiden_size=64", "Option 'hiden_size' is not accepted: did you mean --model.hidden_size?"),
        (  # axolotl's name for continuing a saved adapter
            f"{STRATEGY}.lora_model_dir=runs/adapter",
            "'lora_model_dir' is not accepted: did you mean --trainer.strategy.pretrained_adapter?",
        ),
    ],
    "readability": [
        (f"{STRATEGY}.checkpoint_every_n=0", "checkpoint_every_n=0"),
        (f"{AMP}.init_scale=0", "init_scale=0.0"),
        (f"{AMP}.growth_factor=1.0", "growth_factor=1.0"),
        (f"{AMP}.backoff_factor=1.5", "backoff_factor=1.5"),
        (f"{AMP}.growth_interval=0", "growth_interval=0"),
        (f"{AMP}.min_scale=-1", "min_scale=-1.0"),
        (f"{AMP}.loss_scale=-2.0", "loss_scale=-2.0"),
        (f"{STRATEGY}.qat=int4-weight-only", "quantization= and qat= cannot be combined"),
        (f"{STRATEGY}.fp8=rowwise", "quantization= and fp8= cannot be combined"),
        ("--trainer.callbacks.init_args.window=0", "window=0"),
        ("--data.init_args.val_fraction=1.5", "val_fraction=1.5"),
        ("--data.init_args.seq_len=1", "seq_len=1"),
        ("--model.init_args.hidden_size=130", "hidden_size=130"),
        (f"{STRATEGY}.compile=maybe", "compile='maybe' is not allowed: it takes a bool or a dict"),
        (f'{STRATEGY}.compile={{"modee":"max"}}', "compile={'modee': 'max'} has arguments torch.compile does not take"),
        (  # was Lightning's "Received both `precision=bf16-mixed` and `plugins=<...AMPPrecision object at 0x..>`"
            "--trainer.precision=bf16-mixed",
            "trainer.precision=bf16-mixed and the precision plugin AMPPrecision in trainer.plugins",
            "(--trainer.plugins.init_args.precision=bf16-mixed, ",
        ),
    ],
    "literal": [
        (f"{STRATEGY}.quantization=nf5", "'nf5'", "Did you mean 'nf4'?"),
        (f"{STRATEGY}.quantization.init_args.mode=fp5", "'fp5'", "Did you mean 'fp4'?"),
        (f"{STRATEGY}.checkpoint_impl=reentrnt", "'reentrnt'", "Did you mean 'reentrant'?"),
        (f"{STRATEGY}.optimizer=adamw9bit", "'adamw9bit'", "Did you mean 'adamw8bit'?"),
        (f"{STRATEGY}.qat=int4-weight", "'int4-weight'", "'int4-weight-only'"),
        (f"{STRATEGY}.fp8=rowwize", "'rowwize'", "Did you mean 'rowwise'?"),
        ("--trainer.precision=17-mixed", "'17-mixed'", "Did you mean '16-mixed'?"),
        (f"{AMP}.precision=16mixed", "'16mixed'", "Did you mean '16-mixed'?"),
        (f"{AMP}.precision=fp16", "'fp16'", "Did you mean '16-mixed'?"),  # the plugin's own spellings
        (f"{AMP}.precision=AUTO", "'AUTO'", "Did you mean 'auto'?"),
        ("--trainer.precision=auto", "'auto'", "leave trainer.precision unset and give the plugin's: trainer.plugins:"),
        (f"{AMP}.float32_matmul_precision=hihg", "'hihg'", "Did you mean 'high'?"),
        (f"{AMP}.device=gpu", "'gpu'", "Allowed: 'cpu', 'cuda'"),
        ("--trainer.strategy=lowprec_fsdpp", "'lowprec_fsdpp'", "Did you mean 'lowprec_fsdp'? pl_lowprec's names:"),
        ("--trainer.strategy=qlora", "'qlora'", "pl_lowprec's names: lowprec, lowprec_ddp, lowprec_ddp_spawn,"),
    ],
    "numeric": [
        ("--trainer.accumulate_grad_batches=0", "accumulate_grad_batches=0"),
        ("--trainer.accumulate_grad_batches=-2", "accumulate_grad_batches=-2"),
        ("--trainer.check_val_every_n_epoch=0", "check_val_every_n_epoch=0"),
        ("--trainer.val_check_interval=0", "val_check_interval=0"),
        ("--trainer.gradient_clip_val=-1.0", "gradient_clip_val=-1.0"),
        ("--trainer.log_every_n_steps=-5", "log_every_n_steps=-5"),
        ("--trainer.num_sanity_val_steps=-3", "num_sanity_val_steps=-3"),
        ("--trainer.max_steps=-5", "max_steps"),
        ("--trainer.max_steps=abc", "abc"),
        ("--model.init_args.hidden_size=0", "hidden_size=0"),
        ("--model.init_args.num_layers=0", "num_layers=0"),
        ("--model.init_args.num_heads=0", "num_heads=0"),
        ("--model.init_args.lr=-0.001", "lr=-0.001"),
        ("--model.init_args.warmup_steps=-1", "warmup_steps=-1"),
        ("--data.init_args.batch_size=0", "batch_size=0"),
        ("--data.init_args.max_bytes=10", "max_bytes=10"),
        (f"{STRATEGY}.lora.r=0", "r=0"),
        (f"{STRATEGY}.lora.r=-4", "r=-4"),
        (f"{STRATEGY}.lora.lora_alpha=-16", "lora_alpha=-16"),
        (f"{STRATEGY}.lora.lora_dropout=1.0", "lora_dropout=1.0"),
        ("--trainer.callbacks.init_args.warn_skip_rate=2", "warn_skip_rate=2"),
        ("--trainer.callbacks.init_args.warn_scale_below=-1", "warn_scale_below=-1"),
        ("--trainer.callbacks.init_args.max_consecutive_overflows=0", "max_consecutive_overflows=0"),
    ],
}


def _cases(table: dict[str, list[tuple]]) -> list:
    return [
        pytest.param(case[0], case[1:], id=f"{kind}:{case[0].lstrip('-')}")
        for kind, cases in table.items()
        for case in cases
    ]


def refusal(capsys, args: list[str], usage: bool = False) -> str:
    """Run the CLI, expect exit status 2; the error paragraph, checked for what every refusal must be.

    Everything printed counts towards ``MAX_LINES``, except argparse's usage line where ``usage`` (the small
    subcommands keep it; LightningCLI's, 50 lines of every option, is gone)."""
    with pytest.raises(SystemExit) as exited:
        main(args)
    out, err = capsys.readouterr()
    text = out + err
    assert exited.value.code == 2, text[-3000:]
    assert "Traceback" not in text and "Union subtypes" not in text, text[-3000:]
    lines = [line for line in text.splitlines() if line.strip()]
    if usage:
        assert lines[0].startswith("usage:"), text
        lines = [line for line in lines[1:] if not line.startswith(" ")]
    assert len(lines) <= MAX_LINES, text
    return text[text.index("error:") :].strip()


@pytest.fixture(autouse=True)
def _no_step_runs(monkeypatch):
    """Every refusal comes before the first training step."""

    def step_ran(*args, **kwargs):
        raise AssertionError("a training step ran")

    from pl_lowprec.demo import TinyLlama
    from pl_lowprec.models import CausalLM

    monkeypatch.setattr(sys, "argv", ["pl-lowprec"])  # as from the shell: LightningCLI warns when both are given
    monkeypatch.setattr(TinyLlama, "training_step", step_ran)
    monkeypatch.setattr(CausalLM, "training_step", step_ran)


@pytest.mark.parametrize("argument, named", _cases(QUICKSTART_CASES))
def test_quickstart_bad_value_is_one_paragraph(capsys, tmp_path, argument, named):
    if argument.startswith("--trainer.callbacks.init_args"):  # the quick-start's first callback: LossScaleMonitor
        argument = argument.replace(
            "--trainer.callbacks.init_args", "--trainer.callbacks+=LossScaleMonitor --trainer.callbacks.init_args"
        )
    args = ["fit", f"--config={QUICKSTART}", *FAST, f"--trainer.default_root_dir={tmp_path}", *argument.split()]
    paragraph = refusal(capsys, args)
    for part in named:
        assert part in paragraph, paragraph


@pytest.fixture(scope="module")
def user_files(tmp_path_factory):
    """A pretrained directory with its tokenizer, as from the hub, and a prompt/completion data file."""
    root = tmp_path_factory.mktemp("user")
    pretrained = save_pretrained_dir(root / "model")
    data = root / "pc.jsonl"
    rows = [{"prompt": f"def f{i}(x):\n    return", "completion": f" x + {i}"} for i in range(16)]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return pretrained, data


def finetune_args(pretrained, data, root) -> list[str]:
    return [
        "fit",
        f"--config={FINETUNE}",
        *FAST,
        f"--trainer.default_root_dir={root}",
        f"--model.pretrained={pretrained}",
        f"--data.tokenizer={pretrained}",
        f"--data.train_files={data}",
        "--data.val_files=null",
        "--data.batch_size=4",
        "--trainer.val_check_interval=2",  # the config's 20 is past these 4 batches: refused before loading
        "--trainer.plugins=[]",
        "--trainer.precision=32-true",
        f"{STRATEGY}.activation_checkpointing=null",
    ]


FINETUNE_CASES = {
    "readability": [
        ("--data.train_files=DIR/missing.jsonl", "missing.jsonl", "does not exist"),
        ("--data.train_files=DIR/records.tsv", "records.tsv", "'.tsv'"),
        ('--data.fields={"prompt":"q"}', "fields={'prompt': 'q'}", "is not one format"),
        ("--data.val_files=DIR/missing.jsonl", "val_files", "missing.jsonl"),
        ("--data.train_split=test", "train_split='test'", "has no splits", "Fix: leave train_split out"),
        ("--data.val_split=validation", "val_split='validation') without val_files", "--data.val_files FILE"),
        ("--model.pretrained=DIR/no-model", "no-model"),
        ("--data.tokenizer=DIR", "tokenizer="),
        (
            "--trainer.strategy.class_path=LowPrecisionFSDPStrategy --trainer.strategy.init_args.quantization=int8",
            "quantization='int8' cannot shard",
            "Allowed: 'nf4', 'nf4-dq'",
        ),
    ],
    "numeric": [
        ("--data.batch_size=0", "batch_size=0"),
        ("--data.seq_len=1", "seq_len=1"),
        ("--data.val_fraction=1", "val_fraction=1"),
        ("--data.num_workers=-1", "num_workers=-1"),
        ("--model.lr=-0.1", "lr=-0.1"),
        ("--model.lr=0", "lr=0.0"),
        ("--model.warmup_steps=-5", "warmup_steps=-5"),
        ("--model.weight_decay=-0.01", "weight_decay=-0.01"),
        ("--model.min_lr_ratio=2", "min_lr_ratio=2"),
        ("--model.loss_chunk_size=0", "loss_chunk_size=0"),
        ("--trainer.accumulate_grad_batches=0", "accumulate_grad_batches=0"),
        ("--trainer.val_check_interval=1000", "val_check_interval=1000", "an integer up to"),
        (f"{STRATEGY}.lora.r=0", "r=0"),
    ],
    "literal": [
        (f"{STRATEGY}.quantization=nf4dq", "'nf4dq'", "Did you mean 'nf4-dq'?"),
    ],
}


@pytest.mark.parametrize("argument, named", _cases(FINETUNE_CASES))
def test_user_path_bad_value_is_one_paragraph(capsys, tmp_path, user_files, argument, named):
    pretrained, data = user_files
    (tmp_path / "records.tsv").write_text("prompt\tcompletion\na\tb\n")
    args = [*finetune_args(pretrained, data, tmp_path / "run"), *argument.replace("DIR", str(tmp_path)).split()]
    paragraph = refusal(capsys, args)
    for part in named:
        assert part in paragraph, paragraph


def test_truncated_safetensors_names_the_file(capsys, tmp_path, user_files):
    pretrained, data = user_files
    copy = shutil.copytree(pretrained, tmp_path / "model")
    weights = copy / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    args = [*finetune_args(copy, data, tmp_path / "run")]
    paragraph = refusal(capsys, args)
    assert str(weights) in paragraph and "is not a complete safetensors file" in paragraph, paragraph
    assert "fetch or save the file again" in paragraph


GPT = {"from": "gpt", "value": "yo"}
NO_TURN_END = (  # a base model's ad-hoc template: each turn ends with a newline alone
    "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)


@pytest.mark.parametrize(
    "template, records, named",
    [
        (
            NO_TURN_END,
            [{"messages": [{"role": "user", "content": "1 + 1?"}, {"role": "assistant", "content": "2"}]}] * 8,
            [
                "chats.jsonl, line 1: the chat template ends an assistant turn with no end-of-turn token",
                "eos_after_turns",
            ],
        ),
        (
            None,  # the model's own template; ShareGPT dumps name some answers by the model that wrote them
            [{"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"}]}] * 6
            + [{"conversations": [{"from": "human", "value": "hi"}, {"from": "bing", "value": "x"}, GPT]}] * 2,
            ["chats.jsonl", "turns of role 'bing'", "rename the role 'bing' to 'assistant'", "max_skipped_fraction"],
        ),
    ],
    ids=["template-without-turn-end", "sharegpt-unknown-role"],
)
def test_chat_records_that_would_train_wrong_are_one_paragraph(capsys, tmp_path, user_files, template, records, named):
    """``pl-lowprec fit`` on chat data that trained silently wrong: a template whose turns end with no end token
    (the model never stopped), a role the template does not know (written as a role of its own)."""
    pretrained, _ = user_files
    model = shutil.copytree(pretrained, tmp_path / "model")
    if template is not None:
        save_with_template(model, template, model)
    data = tmp_path / "chats.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in records))
    paragraph = refusal(capsys, finetune_args(model, data, tmp_path / "run"))
    for part in named:
        assert part in paragraph, paragraph


SUBCOMMAND_CASES = [
    (["make-demo-model", "OUT", "--steps", "0"], "--steps: 0 is too small: give an integer >= 1"),
    (["make-demo-model", "OUT", "--steps", "-3"], "--steps: -3 is too small"),
    (["make-demo-model", "OUT", "--steps", "many"], "'many' is not an integer"),
    (["generate", *["--model=M", "--prompts=P", "--out=O"], "--batch_size=0"], "--batch_size: 0 is too small"),
    (["generate", *["--model=M", "--prompts=P", "--out=O"], "--max_new_tokens=0"], "--max_new_tokens: 0 is too small"),
    (["generate", *["--model=M", "--prompts=P", "--out=O"], "--temperature=0"], "--temperature: 0 is not > 0"),
    (["generate", *["--model=M", "--prompts=P", "--out=O"], "--top_p=1.5"], "--top_p: 1.5 is not in (0, 1]"),
    (["generate", *["--model=M", "--prompts=P", "--out=O"], "--top_p=0"], "--top_p: 0 is not in (0, 1]"),
    (["generate", *["--model=M", "--prompts=P", "--out=O"], "--top_k=-1"], "--top_k: -1 is too small"),
    (["generate", *["--model=M", "--prompts=P", "--out=O"], "--fields=question"], "--fields: 'question' is not a"),
    (["generate", *["--model=M", "--prompts=P", "--out=O"], "--fields={a: [b"], "'{a: [b' is not YAML or JSON"),
]


@pytest.mark.parametrize("args, named", SUBCOMMAND_CASES, ids=[" ".join(c[0][-2:]) for c in SUBCOMMAND_CASES])
def test_subcommand_bad_number_is_one_line(capsys, tmp_path, args, named):
    args = [a.replace("OUT", str(tmp_path / "demo")) for a in args]
    assert named in refusal(capsys, args, usage=True)
    assert not (tmp_path / "demo").exists()


def test_python_entry_points_check_their_numbers(tmp_path):
    from pl_lowprec.demo.pretrained import make_demo_model
    from pl_lowprec.export.generate import Decoding

    with pytest.raises(ValueError, match=r"make_demo_model\(steps=0\) must be an integer >= 1"):
        make_demo_model(tmp_path / "demo", steps=0)
    with pytest.raises(ValueError, match=r"Decoding\(top_p=0.0\) must be in \(0, 1\]"):
        Decoding(top_p=0.0)
    with pytest.raises(ValueError, match=r"Decoding\(temperature=0.0\) must be a finite number > 0"):
        Decoding(temperature=0.0)


def test_strategy_checks_trainer_arguments_without_the_cli():
    """Trainer(accumulate_grad_batches=0) is accepted by Lightning and divided by in step 1."""
    from lightning_helpers import quiet_trainer
    from qlora_helpers import ids_loader, tiny_llama

    from pl_lowprec import LowPrecisionStrategy

    trainer = quiet_trainer(strategy=LowPrecisionStrategy(), max_steps=1, accumulate_grad_batches=0)
    with pytest.raises(ValueError, match=r"Trainer\(accumulate_grad_batches=0\) must be an integer >= 1"):
        trainer.fit(tiny_llama(), ids_loader(batches=1))
    assert trainer.global_step == 0


def test_errors_after_the_first_batch_and_bugs_keep_their_traceback(monkeypatch, tmp_path):
    """Only refusals before any batch are shortened: a ValueError in a step, or a RuntimeError while building a
    class (a bug, not a bad value), reaches the caller with its traceback (jsonargparse's wrapping included)."""
    from pl_lowprec.demo import TinyLlama

    args = ["fit", f"--config={QUICKSTART}", *FAST, f"--trainer.default_root_dir={tmp_path}"]

    def bad_step(self, batch, batch_idx):
        raise ValueError("raised inside a step")

    monkeypatch.setattr(TinyLlama, "training_step", bad_step)
    with pytest.raises(ValueError, match="raised inside a step"):
        main(args)

    def broken_init(self, *args, **kwargs):
        raise RuntimeError("a bug in __init__")

    monkeypatch.setattr(TinyLlama, "__init__", broken_init)
    with pytest.raises(ValueError, match="a bug in __init__") as raised:
        main(args)
    assert isinstance(raised.value.__cause__, RuntimeError)


def test_jsonargparse_debug_shows_the_original_error(monkeypatch, tmp_path):
    monkeypatch.setenv("JSONARGPARSE_DEBUG", "true")
    args = ["fit", f"--config={QUICKSTART}", *FAST, f"--trainer.default_root_dir={tmp_path}"]
    with pytest.raises(ValueError, match="Union subtypes"):
        main([*args, f"{STRATEGY}.checkpoint_every_n=0"])


def test_a_rank_other_than_zero_says_which_it_is(capsys, monkeypatch):
    """Each rank of a multi-process run that refuses prints its paragraph; the second one names its rank."""
    from lightning.pytorch.utilities.rank_zero import rank_zero_only

    from pl_lowprec.cli.config_errors import ConfigurationError, refuse

    for rank, start in ((0, "error: "), (1, "[rank: 1] error: ")):
        monkeypatch.setattr(rank_zero_only, "rank", rank)
        with pytest.raises(ConfigurationError):
            refuse("shard_modules: 'Block' matches no module.")
        assert capsys.readouterr().err == f"{start}shard_modules: 'Block' matches no module.\n"


@pytest.mark.parametrize("command", ["fit", "estimate", "plan"])
def test_an_empty_config_file_is_named(capsys, tmp_path, command):
    """jsonargparse says only "Unexpected config", with nothing after it, for a file that holds no YAML."""
    (empty := tmp_path / "empty.yaml").write_text("# to fill in\n")
    said = refusal(capsys, [command, "--config", QUICKSTART, "--config", str(empty)])
    assert f"--config {empty} holds nothing (it is empty, or only comments)" in said
