"""CausalLM: built on the meta device, loaded (and quantized) by the strategy, token-mean loss, chunked loss."""

import json

import pytest
import torch
from lightning.pytorch.callbacks import Callback
from lightning_helpers import quiet_trainer
from loading_helpers import save_pretrained_dir

from pl_lowprec import LowPrecisionStrategy
from pl_lowprec.data import TextDataModule
from pl_lowprec.models import CausalLM
from pl_lowprec.models.causal_lm import warmup_cosine
from pl_lowprec.models.chunked_loss import causal_lm_loss_sum

pytest.importorskip("transformers")
pytest.importorskip("peft")
pytest.importorskip("bitsandbytes")


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory):
    return save_pretrained_dir(tmp_path_factory.mktemp("pretrained"))


@pytest.fixture
def data(tmp_path, pretrained):
    path = tmp_path / "pc.jsonl"
    rows = [{"prompt": f"def f{i}(x):\n    return", "completion": f" x + {i}"} for i in range(24)]
    path.write_text("\n".join(json.dumps(r) for r in rows))
    return TextDataModule(train_files=path, tokenizer=str(pretrained), batch_size=4, val_fraction=0.25)


class Metrics(Callback):
    def __init__(self):
        self.val = []

    def on_validation_end(self, trainer, pl_module):
        self.val.append({k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("val/")})


def test_qlora_fine_tune_from_a_model_directory(pretrained, data):
    metrics = Metrics()
    strategy = LowPrecisionStrategy(quantization="nf4", lora={"r": 8, "lora_alpha": 16})
    trainer = quiet_trainer(strategy=strategy, max_steps=15, callbacks=[metrics])
    model = CausalLM(str(pretrained), lr=1e-2, warmup_steps=2)
    trainer.fit(model, datamodule=data)
    assert trainer.global_step == 15
    assert type(model.model.model.layers[0].self_attn.q_proj.base_layer).__name__ == "Linear4bit"
    first, last = metrics.val[1], metrics.val[-1]  # [0] is the sanity check
    assert last["val/perplexity"] == pytest.approx(torch.exp(torch.tensor(last["val/loss"])).item(), rel=1e-5)
    assert last["val/loss"] < first["val/loss"]


class MicroBatchLosses(Callback):
    """Each micro-batch's logged mean and its target tokens; the logged step loss at each optimizer step."""

    def __init__(self):
        self.micro, self.steps = [], []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        tokens = int((batch["labels"][:, 1:] != -100).sum())
        self.micro.append((float(trainer.callback_metrics["train/loss"]), tokens))
        if len(self.micro) % trainer.accumulate_grad_batches == 0:  # this batch stepped
            self.steps.append(float(trainer.callback_metrics["train/step_loss"]))


def test_the_step_loss_is_the_windows_mean_per_target_token_and_on_the_bar(pretrained, data):
    """With accumulation, ``train/loss`` is one micro-batch's; ``train/step_loss`` is what the step optimized."""
    record = MicroBatchLosses()
    trainer = quiet_trainer(max_steps=2, accumulate_grad_batches=2, callbacks=[record], limit_val_batches=0)
    trainer.fit(CausalLM(str(pretrained), lr=1e-2), datamodule=data)
    windows = [record.micro[0:2], record.micro[2:4]]
    expected = [sum(loss * n for loss, n in w) / sum(n for _, n in w) for w in windows]
    assert record.steps == pytest.approx(expected, rel=1e-5)
    assert abs(expected[0] - windows[0][1][0]) > 1e-3  # the last micro-batch's loss differs: the test can tell
    assert "train/step_loss" in trainer.progress_bar_metrics and "train/loss" not in trainer.progress_bar_metrics


def test_validation_logs_the_ranks_mean_without_lightnings_sync_dist_advice(pretrained, data):
    """The metric is the all-rank mean already; Lightning warned "use sync_dist=True" on every validation of a
    multi-rank run (DDP on one rank here)."""
    import warnings

    import torch.distributed as dist

    metrics = Metrics()
    trainer = quiet_trainer(strategy="ddp", callbacks=[metrics])
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            trainer.validate(CausalLM(str(pretrained)), datamodule=data)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    assert not [str(w.message) for w in caught if "sync_dist=True" in str(w.message)]
    (val,) = metrics.val
    assert val["val/perplexity"] == pytest.approx(torch.exp(torch.tensor(val["val/loss"])).item(), rel=1e-5)


def test_plain_lightning_strategy_loads_the_same_weights(pretrained):
    from transformers import AutoModelForCausalLM

    model = CausalLM(str(pretrained))
    trainer = quiet_trainer(max_steps=0)
    trainer.strategy._lightning_module = model  # what fit does before configure_model
    model.trainer = trainer
    model.configure_model()
    reference = AutoModelForCausalLM.from_pretrained(pretrained)
    ids = torch.randint(0, 300, (2, 12))
    torch.testing.assert_close(model(ids), reference(input_ids=ids).logits, rtol=0, atol=0)


def test_chunked_loss_equals_the_whole_and_holds_less_at_vocab_32000():
    torch.manual_seed(0)
    head = torch.nn.Linear(32, 32000, bias=False)
    hidden = torch.randn(2, 64, 32, requires_grad=True)
    labels = torch.randint(0, 32000, (2, 64))
    labels[:, :20] = -100
    results = {}
    for chunk in (None, 16):
        saved: list[int] = []

        def pack(t, saved=saved):
            saved.append(t.numel() * t.element_size())
            return t

        hidden.grad = head.weight.grad = None
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss, _ = causal_lm_loss_sum(head, hidden, labels, chunk)
        loss.backward()
        results[chunk] = (loss.detach(), hidden.grad.clone(), head.weight.grad.clone(), sum(saved))
    whole, chunked = results[None], results[16]
    torch.testing.assert_close(chunked[0], whole[0])
    torch.testing.assert_close(chunked[1], whole[1])
    torch.testing.assert_close(chunked[2], whole[2])
    logits_bytes = 2 * 63 * 32000 * 4
    assert whole[3] >= logits_bytes  # the whole batch's fp32 logits (and log-softmax) are kept for backward
    assert chunked[3] < logits_bytes / 50  # only hidden-state chunks are kept


def test_chunks_without_a_target_skip_the_head_and_the_rest_give_the_whole_loss():
    from pl_lowprec.models.chunked_loss import chunk_loss

    torch.manual_seed(0)
    head = torch.nn.Linear(16, 50, bias=False)
    hidden = torch.randn(2, 44, 16)  # 43 positions predict a target: 5 chunks of 8 and one of 3
    labels = torch.randint(0, 50, (2, 44))
    labels[:, :18] = -100  # targets are labels[:, 1:]: positions 0-16 have none, so chunks 0 and 1 are skipped
    labels[:, 41:] = -100  # and positions 40-42: the last, short chunk
    labels[0, 30] = -100
    chunks = []

    def counted(head, hidden, labels, recompute=False, grouped=True):
        chunks.append(hidden.shape[1])
        return chunk_loss(head, hidden, labels, recompute, grouped)

    loss, tokens = causal_lm_loss_sum(head, hidden, labels, 8, counted)
    whole, whole_tokens = causal_lm_loss_sum(head, hidden, labels, None)
    assert chunks == [8, 8, 8] and tokens == whole_tokens == 2 * 23 - 1  # chunks 2-4: positions 16-39
    torch.testing.assert_close(loss, whole)


def test_warmup_then_cosine():
    f = warmup_cosine(warmup_steps=4, total_steps=14, min_ratio=0.1)
    assert [f(s) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert f(9) == pytest.approx(0.55) and f(14) == pytest.approx(0.1) and f(40) == pytest.approx(0.1)


def test_hub_id_without_network_says_what_to_do(monkeypatch):
    import huggingface_hub

    def offline(*args, **kwargs):
        raise ConnectionError("no network")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", offline)
    with pytest.raises(
        ValueError,
        match=r"'meta-llama/Llama-3.2-1B' is not a local directory.*ConnectionError: no"
        r" network.*hf download meta-llama/Llama-3.2-1B --local-dir DIR",
    ):
        CausalLM("meta-llama/Llama-3.2-1B")


def test_the_download_command_named_is_the_installed_huggingface_hubs():
    """The refusal's fix is a command the user has: huggingface_hub >= 1.0 installs ``hf`` and no longer
    ``huggingface-cli``, which the advice named before."""
    from importlib.metadata import entry_points

    from pl_lowprec.loading.hub import DOWNLOAD_COMMAND

    scripts = {e.name: e.value for e in entry_points(group="console_scripts")}
    program = DOWNLOAD_COMMAND.split()[0]
    assert scripts.get(program, "").startswith("huggingface_hub."), (program, sorted(scripts))


def test_bad_arguments(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # no runs/demo/model here, whatever the checkout holds
    with pytest.raises(ValueError, match=r"has no config.json"):
        CausalLM(str(tmp_path))
    with pytest.raises(ValueError, match=r"is neither a model directory nor a hub id.*the path does not exist") as e:
        CausalLM(str(tmp_path / "nope"))
    assert "make-demo-model" not in str(e.value)
    with pytest.raises(ValueError, match=r"the path does not exist .* `pl-lowprec make-demo-model runs/demo`"):
        CausalLM("runs/demo/model")  # the shipped configs' model, not made yet
    (tmp_path / "runs").mkdir()
    with pytest.raises(ValueError, match=r"'runs/merged' is neither a model directory nor a hub id.*does not exist"):
        CausalLM("runs/merged")  # a local path mistyped (runs/ is here), not a repository to download
    with pytest.raises(ValueError, match=r"loss_chunk_size=0\) must be a positive"):
        CausalLM("x/y", loss_chunk_size=0)


def test_the_head_runs_as_one_matrix_product_for_a_single_sequence():
    """A chunk of one sequence (batch 1) is a "contiguous" 3-D view that matmul cannot fold into rows, so the head
    ran as a bmm: 16x slower than mm in bf16 on a CPU. The loss hands the head 2-D rows."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from pl_lowprec.models.chunked_loss import causal_lm_loss_sum

    class Products(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.names = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if "mm" in func.__name__:
                self.names.append(func.__name__.split(".")[0])
            return func(*args, **(kwargs or {}))

    head = torch.nn.Linear(32, 100, bias=False).requires_grad_(False)
    hidden = torch.randn(1, 17, 32, requires_grad=True)
    labels = torch.randint(0, 100, (1, 17))
    with Products() as seen:
        loss, _ = causal_lm_loss_sum(head, hidden, labels, 8)
        loss.backward()
    assert seen.names and set(seen.names) == {"mm"}, seen.names


class NarrowCausalLM(CausalLM):
    """A user's subclass that names only some of CausalLM's arguments."""

    def __init__(self, pretrained: str, lr: float = 1e-3) -> None:
        super().__init__(pretrained, lr=lr, warmup_steps=1)


def test_a_subclass_built_by_lightning_cli_trains_with_the_arguments_it_passed_on(pretrained, data):
    """LightningCLI saves only the subclass's own arguments as hparams; CausalLM's others are read back in
    configure_optimizers, and were missing ('AttributeDict' object has no attribute 'weight_decay')."""
    from lightning.pytorch.core.mixins.hparams_mixin import _given_hyperparameters_context

    given = {"pretrained": str(pretrained), "lr": 5e-3}
    with _given_hyperparameters_context(hparams=given, instantiator="lightning.pytorch.cli.instantiate_module"):
        model = NarrowCausalLM(**given)  # as LightningCLI builds --model NarrowCausalLM
    assert (model.hparams.lr, model.hparams.warmup_steps, model.hparams.weight_decay) == (5e-3, 1, 0.0)
    assert set(model.hparams) >= {"pretrained", "lr", "min_lr_ratio", "loss_chunk_size", "loss_kernel", "dtype"}
    trainer = quiet_trainer(strategy=LowPrecisionStrategy(lora={"r": 4}), max_steps=1)
    trainer.fit(model, datamodule=data)
    assert trainer.optimizers[0].param_groups[0]["initial_lr"] == 5e-3
