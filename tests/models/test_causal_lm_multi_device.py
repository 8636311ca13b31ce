"""The user's multi-device path for ``CausalLM`` + ``TextDataModule``, through ``pl-lowprec fit`` with the shipped
``configs/finetune-causal-lm.yaml``: a pretrained-format checkpoint of SmolLM2-135M's shapes (tied embeddings,
hidden 576, 9 heads, 3 KV heads; 2 layers and a small vocabulary) with a chat template, on one process and on 2
CPU ranks (lowprec_ddp, lowprec_fsdp): the first round through Lightning's launcher, as the user's command, the
resumed rounds started as torchrun starts ranks (tests/warm_python.py); then ``pl-lowprec export`` and
``pl-lowprec generate`` from the runs."""

import json
import os
import signal
import sys
from pathlib import Path

import pytest
import torch
import warm_python
from model_shapes import SMOLLM2_135M

pytest.importorskip("transformers")
pytest.importorskip("peft")
pytest.importorskip("bitsandbytes")
pytest.importorskip("torchao")

SCRIPTS = Path(__file__).parents[1] / "_scripts"


def smollm2_config(tokenizer) -> dict:
    """SmolLM2-135M with 2 layers and the test tokenizer's vocabulary and special tokens."""
    shape = {k: v for k, v in SMOLLM2_135M.items() if k not in ("architectures", "torch_dtype")}
    return {
        **shape,
        "num_hidden_layers": 2,
        "vocab_size": len(tokenizer),
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
    }


def write_spec(root: Path) -> dict:
    """The pretrained directory (save_pretrained: weights, config, tokenizer with a chat template), chat records
    to fine-tune on and prompts to complete; returns the spec the script reads."""
    from loading_helpers import save_tokenizer
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    pretrained = save_tokenizer(root / "pretrained")
    tokenizer = AutoTokenizer.from_pretrained(pretrained)
    torch.manual_seed(0)
    config = LlamaConfig(**smollm2_config(tokenizer))
    model = LlamaForCausalLM(config)
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight  # tied, as SmolLM2
    model.save_pretrained(pretrained)
    words = ["zero", "one", "two", "three", "four", "five", "six", "seven"]

    def chat(i: int) -> dict:
        question = {"role": "user", "content": f"def f{i}(x): what does it return?"}
        return {"messages": [question, {"role": "assistant", "content": f"return x + {words[i % 8]}"}]}

    (root / "train.jsonl").write_text("".join(json.dumps(chat(i)) + "\n" for i in range(32)))
    (root / "val.jsonl").write_text("".join(json.dumps(chat(i)) + "\n" for i in range(32, 36)))
    (root / "prompts.txt").write_text("def f1(x):\nimport os\nclass A:\n")
    spec = {
        "pretrained": str(pretrained),
        "train": str(root / "train.jsonl"),
        "val": str(root / "val.jsonl"),
        "prompts": str(root / "prompts.txt"),
    }
    (root / "spec.json").write_text(json.dumps(spec))
    return spec


def launch(root: Path, steps: list[str], ranks: int | None = None) -> warm_python.WarmProcess | warm_python.WarmRanks:
    """One process, whose 2-device fits Lightning's launcher expands to 2 ranks as for `pl-lowprec fit`; or
    ``ranks`` processes, started as torchrun starts them."""
    env = {
        **warm_python.with_pythonpath(SCRIPTS),
        # MKL's reproducible mode. Without it, on an Intel Xeon with 2 threads, FSDP's first micro-batch after
        # a resume came out 2.4e-7 (relative) off the killed run's, though the weights were the same bits (the
        # next micro-batch was equal): MKL may round differently with its inputs' alignment and threads.
        "MKL_CBWR": os.environ.get("MKL_CBWR", "AUTO,STRICT"),
    }
    command = [sys.executable, str(SCRIPTS / "causal_lm_cli.py"), str(root), ",".join(steps)]
    if ranks is None:
        return warm_python.WarmProcess(command, env=env)
    return warm_python.WarmRanks(command, ranks, env=env)


def finish(process: warm_python.WarmProcess | warm_python.WarmRanks, expect: int = 0) -> str:
    _, stderr = process.communicate(timeout=600)
    assert process.returncode == expect, stderr[-5000:]
    return stderr


# One process holds the same global batch and the same 4-bit storage as the 2 ranks: bitsandbytes NF4 for DDP,
# torchao NF4 with scale groups of 32 for FSDP (every layer splits with 32 on 1 and on 2 ranks).
REFERENCE = {"ddp": "lowprec", "fsdp": "fsdp_one"}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Every fit, in 3 rounds: a 2-rank launch beside a 1-process one (while one waits in a collective). Each
    killed run ends its launch and the next resumes it. Returns ROOT and the stderr of each launch."""
    root = tmp_path_factory.mktemp("causal_lm_cli")
    write_spec(root)
    killed = -signal.SIGKILL
    two = launch(root, ["fsdp_auto", "lightning_fsdp", "ddp.killed"])  # Lightning's launcher, as the user's
    one = launch(root, ["lowprec", "lightning", "fsdp_one", "lowprec.killed"])
    logs = {"first": finish(two, killed), "one": finish(one, killed)}
    two, one = launch(root, ["ddp.resumed", "fsdp.killed"], ranks=2), launch(root, ["lowprec.resumed"])
    logs["second"], logs["one.resumed"] = finish(two, killed), finish(one)
    logs["third"] = finish(launch(root, ["fsdp.resumed"], ranks=2))
    return root, logs


# Adapters after 4 AdamW steps at lr 0.01 on 2 ranks against one process. The first gradients agree to 6e-8, but
# Adam divides each by its own running size, so a weight whose gradient is near Adam's eps (1e-8) moves by an amount
# that rounding decides: most weights agree to 2e-5 (1.7e-5 on an AMX Xeon, 1.1e-5 on an AVX-512 EPYC), and a rare
# one by more (1.4e-4: 1 of 4,608, after TokenMeanLoss moved where its window factor rounds). A step lost or
# repeated on resume moves every weight with a gradient by about lr (1e-2; Adam's first update is lr * sign(g)):
# far above ADAPTER_CEILING, and on far more than ADAPTER_OUTLIERS of them.
ADAPTERS_ACROSS_RANKS = {"rtol": 1e-4, "atol": 1e-4}
ADAPTER_CEILING = 1e-3  # a tenth of one Adam step: no weight may be off by more
ADAPTER_OUTLIERS = 1e-3  # the share of a tensor's weights that may be off by more than ADAPTERS_ACROSS_RANKS


def last_checkpoint(root: Path, directory: str) -> str:
    return str(root / directory / "run" / "version_0" / "checkpoints" / "last.ckpt")


def load(root: Path, run: str, name: str = "record.pt") -> dict:
    return torch.load(root / run / name, weights_only=False)


def assert_all_close(actual: dict, expected: dict, **tolerance) -> None:
    assert sorted(actual) == sorted(expected)
    for key in expected:
        torch.testing.assert_close(actual[key], expected[key], **tolerance, msg=lambda m, k=key: f"{k}: {m}")


def assert_adapters_agree(actual: dict, expected: dict) -> None:
    """Within ``ADAPTERS_ACROSS_RANKS`` but for a rare weight whose gradient rounding set apart; no weight off by
    ``ADAPTER_CEILING`` (see above)."""
    assert sorted(actual) == sorted(expected)
    for key, reference in expected.items():
        apart = (actual[key] - reference).abs()
        allowed = ADAPTERS_ACROSS_RANKS["atol"] + ADAPTERS_ACROSS_RANKS["rtol"] * reference.abs()
        outliers = (apart > allowed).float().mean().item()
        assert apart.max() < ADAPTER_CEILING, f"{key}: off by {apart.max():.2e}"
        assert outliers <= ADAPTER_OUTLIERS, f"{key}: {outliers:.2%} of the weights off by more than {allowed.max()}"


def losses(record: dict) -> torch.Tensor:
    return torch.tensor([loss for _, loss in record["losses"]], dtype=torch.float64)


@pytest.mark.slow
@pytest.mark.parametrize("run", ["ddp", "fsdp"])
def test_two_ranks_killed_and_resumed_train_like_one_uninterrupted_process(runs, run):
    """The loss of each micro-batch over the global batch, the first step's gradients and the final adapters equal
    one process's uninterrupted run: killed with SIGKILL at step 3 and resumed with --ckpt_path last (from step 2)."""
    root, logs = runs
    killed, resumed = load(root, f"{run}.resume", "killed.pt"), load(root, f"{run}.resume")
    expected = load(root, REFERENCE[run])
    # 4 optimizer steps of 2 micro-batches: the killed run did 6, the resumed one the last 4
    assert [step for step, _ in killed["losses"]] == [0, 1, 1, 2, 2, 3]
    assert [step for step, _ in resumed["losses"]] == [2, 3, 3, 4]
    # the 2 micro-batches after the checkpoint, trained again after the restart: the same, to the last bit
    assert resumed["losses"][:2] == killed["losses"][4:]
    both = torch.cat([losses(killed)[:4], losses(resumed)])
    torch.testing.assert_close(both, losses(expected), rtol=1e-5, atol=1e-6)
    # averaged, not summed, over the ranks (Adam would hide a factor of 2 in the adapters)
    assert_all_close(killed["grads"], expected["grads"], rtol=1e-4, atol=1e-7)
    assert_adapters_agree(resumed["adapters"], expected["adapters"])
    assert len(expected["adapters"]) == 2 * 7 * 2 and all(v.abs().max() > 0 for v in expected["adapters"].values())
    assert "mixed torch.Tensor and DTensor" not in logs["second"]


@pytest.mark.slow
def test_one_process_killed_and_resumed_equals_the_uninterrupted_run(runs):
    root, _ = runs
    killed, resumed, uninterrupted = (
        load(root, "lowprec.resume", "killed.pt"),
        load(root, "lowprec.resume"),
        load(root, "lowprec"),
    )
    assert killed["losses"] + resumed["losses"][2:] == uninterrupted["losses"]
    assert_all_close(resumed["adapters"], uninterrupted["adapters"], rtol=0, atol=0)


@pytest.mark.slow
def test_lightning_model_parallel_strategy_trains_like_one_process(runs):
    """Lightning's own FSDP2 strategy asks configure_model to shard: CausalLM shards its decoder layers and itself
    (without it, each rank would train its own copy with no gradient sync)."""
    root, logs = runs
    got, expected = load(root, "lightning_fsdp"), load(root, "lightning")
    assert "CausalLM: FSDP2 on 2 blocks and the module as the root." in logs["first"]
    # the first step's micro-batches see the same weights; later ones, weights Adam set up to 2e-4 apart (below)
    torch.testing.assert_close(losses(got)[:2], losses(expected)[:2], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(losses(got)[2:], losses(expected)[2:], rtol=1e-4, atol=1e-6)
    assert_all_close(got["grads"], expected["grads"], rtol=1e-4, atol=1e-7)
    assert len(got["adapters"]) == 20  # full fine-tuning: every weight (the tied embedding once)
    # Adam turns the gradients' 1e-7 differences into up to 2e-4 on weights whose gradient is near 0 (lr 0.01)
    assert_all_close(got["adapters"], expected["adapters"], rtol=0, atol=1e-3)


@pytest.mark.slow
def test_default_nf4_settings_shard_the_tied_checkpoint_and_it_trains(runs):
    root, logs = runs
    assert (
        "NF4 nf4_scaler_block_size='auto' across 2 ranks: 256 for 6 layers (mlp.gate_proj, mlp.up_proj,"
        " mlp.down_proj); 32 for 8 layers (self_attn.q_proj, self_attn.k_proj, self_attn.v_proj, self_attn.o_proj)."
    ) in logs["first"]
    record = load(root, "fsdp_auto")
    train, val = losses(record), [loss for _, loss in record["val_losses"]]
    # it learns, and what it learns holds on the held-out chats: both validations far below the first training loss
    assert train[-2:].mean() < train[:2].mean() - 1.0 and len(val) == 2, (train, val)
    assert max(val) < train[:2].mean() - 1.0, (train, val)


def merged_reference(pretrained: str, adapters: dict) -> dict:
    """The pretrained weights plus alpha / r * B @ A of one process's adapters (lora_alpha 16, r 8)."""
    from safetensors.torch import load_file

    weights = load_file(Path(pretrained) / "model.safetensors")
    for key, a in adapters.items():
        if ".lora_A." in key:
            b = adapters[key.replace(".lora_A.", ".lora_B.")]
            name = key.removeprefix("model.").replace(".lora_A.default", "")
            weights[name] = weights[name] + 2.0 * b @ a
    return weights


@pytest.mark.slow
@pytest.mark.parametrize("run", ["ddp", "fsdp"])
def test_export_and_generate_from_the_two_rank_checkpoint_give_the_one_process_results(runs, run, capsys):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from pl_lowprec.cli import main
    from pl_lowprec.data.text import load_tokenizer
    from pl_lowprec.export.generate import Decoding, Generator

    root, _ = runs
    spec = json.loads((root / "spec.json").read_text())
    expected = load(root, REFERENCE[run])["adapters"]
    ckpt = last_checkpoint(root, f"{run}.resume")
    out = root / f"{run}.export"
    # the run's config.yaml (beside checkpoints/) names the test's callbacks, which this process cannot import
    main(["export", f"--ckpt_path={ckpt}", f"--out={out / 'adapter'}"])
    main(["export", f"--ckpt_path={ckpt}", f"--out={out / 'merged'}", "--merged"])
    prompts = ["--prompts", str(root / "prompts.txt"), "--max_new_tokens=8"]
    main(["generate", f"--model={out / 'merged'}", *prompts, f"--out={out / 'merged.jsonl'}"])

    adapter = load_file(out / "adapter" / "adapter_model.safetensors")
    renamed = {
        f"model.{k.removeprefix('base_model.model.')}".replace(".weight", ".default.weight"): v
        for k, v in adapter.items()
    }
    assert_adapters_agree(renamed, expected)
    merged = load_file(out / "merged" / "model.safetensors")
    assert "lm_head.weight" not in merged  # tied, as in the pretrained directory
    # the merge is exact for the adapters it merged; how close those are to one process's is asserted above
    assert_all_close(merged, merged_reference(spec["pretrained"], renamed), rtol=1e-5, atol=1e-6)

    model = AutoModelForCausalLM.from_pretrained(out / "merged")
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    reference = AutoModelForCausalLM.from_pretrained(spec["pretrained"])
    reference.load_state_dict(merged_reference(spec["pretrained"], expected), strict=False)
    prompt_lines = (root / "prompts.txt").read_text().splitlines()
    want = Generator(reference, load_tokenizer(spec["pretrained"])).complete(prompt_lines, Decoding(max_new_tokens=8))
    got = [json.loads(line)["completion"] for line in (out / "merged.jsonl").read_text().splitlines()]
    assert got == want and any(got), (got, want)  # a prompt may be answered by EOS at once, on both sides

    # from the checkpoints, as trained (4-bit base and adapters, rebuilt on one process): the same as one process's
    checkpoints = {run: ckpt, REFERENCE[run]: last_checkpoint(root, REFERENCE[run])}
    completions = {}
    for name, path in checkpoints.items():
        main(["generate", f"--ckpt_path={path}", *prompts, f"--out={out / f'{name}.ckpt.jsonl'}"])
        completions[name] = [json.loads(line) for line in (out / f"{name}.ckpt.jsonl").read_text().splitlines()]
    assert completions[run] == completions[REFERENCE[run]] and len(completions[run]) == 3, completions


def edited_config(root: Path, name: str, edit) -> Path:
    """A copy of the ddp run's saved config.yaml, changed by ``edit``."""
    import yaml

    fields = yaml.safe_load((root / "ddp.resume" / "run" / "version_0" / "config.yaml").read_text())
    edit(fields)
    path = root / name
    path.write_text(yaml.safe_dump(fields))
    return path


@pytest.mark.slow
def test_export_drops_training_only_settings_and_names_a_class_it_cannot_import(runs, capsys):
    from pl_lowprec.cli import main

    root, _ = runs
    ckpt = last_checkpoint(root, "ddp.resume")

    def unimportable_callback_and_logger(fields):
        fields["trainer"]["callbacks"].append({"class_path": "not_installed.callbacks.Tracker"})
        fields["trainer"]["logger"] = {"class_path": "not_installed.loggers.Logger", "init_args": {"x": 1}}
        fields["trainer"]["profiler"] = {"class_path": "not_installed.Profiler"}

    config = edited_config(root, "callback.yaml", unimportable_callback_and_logger)
    main(["export", f"--ckpt_path={ckpt}", f"--config={config}", f"--out={root / 'callback.adapter'}"])
    assert (root / "callback.adapter" / "adapter_model.safetensors").is_file()

    def unimportable_model(fields):
        fields["model"]["class_path"] = "not_installed.models.MyCausalLM"

    config = edited_config(root, "model.yaml", unimportable_model)
    capsys.readouterr()
    for command in (
        ["export", f"--out={root / 'model.adapter'}"],
        ["generate", f"--prompts={root / 'prompts.txt'}", "--out=c.jsonl"],
    ):
        with pytest.raises(SystemExit) as exit_info:
            main([*command, f"--ckpt_path={ckpt}", f"--config={config}"])
        assert exit_info.value.code == 2
        stderr = capsys.readouterr().err
        assert stderr.count("\n") == 1 and "usage:" not in stderr, stderr
        assert (
            f"pl-lowprec {command[0]}: error: model class_path 'not_installed.models.MyCausalLM' in {config} cannot be"
            " imported (ModuleNotFoundError: No module named 'not_installed')"
        ) in stderr
