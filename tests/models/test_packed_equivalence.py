"""A packed batch through ``CausalLM`` gives the summed token loss and gradients of the same samples unpacked.

The model is a real ``LlamaForCausalLM`` (tiny config, ``save_pretrained``), so the check covers what
transformers does with restarting ``position_ids`` and no ``attention_mask``: a block-causal mask
(``masking_utils.find_packed_sequence_indices``), for any batch size, only when no mask is passed.
"""

import pytest
import torch
from loading_helpers import save_llama

from pl_lowprec.data.collate import PackedCollate, PadCollate
from pl_lowprec.data.packing import PackedRows

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory):
    return save_llama(tmp_path_factory.mktemp("llama"), hidden_size=32, layers=2, vocab_size=64)


def _samples():
    torch.manual_seed(0)
    samples = []
    for n, prompt in [(9, 3), (5, 2), (12, 0), (4, 1), (7, 4), (6, 2)]:
        ids = torch.randint(1, 64, (n,))
        labels = ids.clone()
        labels[:prompt] = -100
        samples.append({"input_ids": ids, "labels": labels})
    return samples


def _loss_and_grads(pretrained, attn, batch):
    from transformers import LlamaForCausalLM

    from pl_lowprec.models import CausalLM

    lm = CausalLM(str(pretrained))
    lm.model = LlamaForCausalLM.from_pretrained(pretrained, attn_implementation=attn)
    loss, tokens = lm.loss_sum(batch)
    loss.backward()
    return loss.detach(), int(tokens), {n: p.grad for n, p in lm.named_parameters()}


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("seq_len", [16, 48])  # 3 rows, and a single row holding every sample
def test_packed_batch_equals_the_samples_unpacked(pretrained, attn, seq_len):
    samples = _samples()
    rows = PackedRows(samples, seq_len=seq_len, seed=0)
    packed = PackedCollate(pad_token_id=0)([rows[i] for i in range(len(rows))])
    assert packed["input_ids"].shape[0] == (3 if seq_len == 16 else 1)
    unpacked = PadCollate(pad_token_id=0)(samples)
    loss, tokens, grads = _loss_and_grads(pretrained, attn, packed)
    ref_loss, ref_tokens, ref_grads = _loss_and_grads(pretrained, attn, unpacked)
    assert tokens == ref_tokens == sum(int((s["labels"][1:] != -100).sum()) for s in samples)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-5)
    for name, grad in ref_grads.items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)


def test_an_attention_mask_turns_the_block_causal_mask_off(pretrained):
    """The trigger in transformers 5.x: restarting position_ids *and no attention_mask*; a mask of ones loses it."""
    samples = _samples()
    rows = PackedRows(samples, seq_len=48, seed=0)
    packed = PackedCollate(pad_token_id=0)([rows[0]])
    loss, _, _ = _loss_and_grads(pretrained, "sdpa", packed)
    masked, _, _ = _loss_and_grads(
        pretrained, "sdpa", {**packed, "attention_mask": torch.ones_like(packed["input_ids"])}
    )
    assert not torch.allclose(loss, masked, rtol=1e-3)


def test_fit_and_validate_with_packing_through_the_trainer(tmp_path):
    """The user's path: CausalLM + TextDataModule(packing=True) under a Trainer; packed validation is exact."""
    import json

    import lightning.pytorch as pl
    from loading_helpers import save_pretrained_dir

    from pl_lowprec.data import TextDataModule
    from pl_lowprec.models import CausalLM

    pretrained = save_pretrained_dir(tmp_path / "pretrained")
    rows = [{"prompt": f"def f{i}(x):\n    return", "completion": " x" + " + 1" * (i % 7)} for i in range(24)]
    (tmp_path / "pc.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))

    def fitted(packing: bool) -> tuple[float, CausalLM]:
        torch.manual_seed(0)
        data = TextDataModule(
            str(tmp_path / "pc.jsonl"), str(pretrained), seq_len=64, batch_size=2, val_fraction=0.25, packing=packing
        )
        trainer = pl.Trainer(
            accelerator="cpu", precision="32-true", max_steps=2, logger=False, enable_checkpointing=False,
            enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
        )  # fmt: skip
        model = CausalLM(str(pretrained), lr=1e-3, warmup_steps=1)
        trainer.fit(model, datamodule=data)
        return trainer.validate(model, datamodule=data, verbose=False)[0]["val/loss"], model

    packed_loss, packed_model = fitted(True)
    assert "attention_mask" not in next(iter(packed_model.trainer.datamodule.val_dataloader()))
    _, plain_model = fitted(False)
    # the same weights validated on unpacked batches give the packed figure
    plain_model.load_state_dict(packed_model.state_dict())
    trainer = pl.Trainer(accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False)
    unpacked = trainer.validate(plain_model, datamodule=plain_model.trainer.datamodule, verbose=False)[0]["val/loss"]
    assert abs(packed_loss - unpacked) < 1e-5


def test_with_a_cache_transformers_lets_packed_samples_attend_to_each_other(pretrained):
    """Why ``forward_batch`` passes ``use_cache=False`` (issue 30): a model whose config has ``use_cache: true``, as
    most hub models, makes a cache in training too, and with a cache transformers builds no block-causal mask."""
    from transformers import LlamaForCausalLM

    samples = _samples()
    rows = PackedRows(samples, seq_len=48, seed=0)
    packed, unpacked = PackedCollate(pad_token_id=0)([rows[0]]), PadCollate(pad_token_id=0)(samples)
    model = LlamaForCausalLM.from_pretrained(pretrained, attn_implementation="sdpa").train()
    assert model.config.use_cache

    def loss(batch, **kwargs):
        return model(**batch, **kwargs).loss

    reference = loss(unpacked, use_cache=False)
    torch.testing.assert_close(loss(packed, use_cache=False), reference, rtol=1e-5, atol=1e-6)
    assert not torch.allclose(loss(packed), reference, rtol=1e-3)  # the cache: samples attend to each other
