"""Memory is sized for the longest batch the training data makes, not the first one the loader draws: with rows of
mixed lengths the first batch depended on the shuffle seed, and a peak predicted from a short one held only until
a long batch came."""

import json

import pytest
import torch
from loading_helpers import save_pretrained_dir

from pl_lowprec import LowPrecisionStrategy, estimate_memory
from pl_lowprec.memory.sizing_batch import sizing_batch

pytest.importorskip("transformers")

BATCH = 4


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory):
    return save_pretrained_dir(tmp_path_factory.mktemp("pretrained"))


@pytest.fixture(scope="module")
def mixed(tmp_path_factory):
    """4 long records among 28 short ones: most batches are short, a few are long."""
    path = tmp_path_factory.mktemp("data") / "mixed.jsonl"
    rows = [{"prompt": f"def f{i}(x):", "completion": " return x"} for i in range(28)]
    rows[::7] = [{"prompt": "def g(x):\n" + "    y = x + 1\n" * 20, "completion": " return y"}] * 4
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def data(pretrained, mixed, seed, **kwargs):
    from pl_lowprec.data import TextDataModule

    module = TextDataModule(
        train_files=mixed, tokenizer=pretrained, batch_size=BATCH, seq_len=256, val_fraction=0, seed=seed, **kwargs
    )
    module.setup("fit")
    return module


def length(batch) -> int:
    return batch["input_ids"].shape[1]


@pytest.mark.parametrize("packing", [False, True])
def test_the_longest_row_bounds_every_batch_and_the_sizing_batch_is_that_long(pretrained, mixed, packing):
    firsts, sized = set(), set()
    for seed in range(6):
        module = data(pretrained, mixed, seed, packing=packing)
        batches = list(module.train_dataloader())
        longest = module.longest_train_row()
        assert max(map(length, batches)) <= longest  # what a whole epoch draws stays within it
        batch, said = sizing_batch(batches[0], module)
        firsts.add(length(batches[0]))
        sized.add(length(batch))
        assert batch["input_ids"].shape == (batches[0]["input_ids"].shape[0], max(longest, length(batches[0])))
        assert "the longest batch the training data makes" in said
    assert sized == {max(sized)}  # one figure whatever the shuffle
    if not packing:
        assert len(firsts) > 1  # the shuffle did change the first batch: the case the sizing is for
        assert max(sized) == max(firsts)  # the longest padded batch, as one of the seeds drew it


def test_a_loader_that_does_not_say_its_longest_row_is_named(pretrained, mixed):
    batch = next(iter(data(pretrained, mixed, 0).train_dataloader()))
    same, said = sizing_batch(batch, None)
    assert same is batch
    assert said.endswith("the first training batch (the loaders given to fit do not say the longest row,"
                         " longest_train_row(): a longer batch needs more memory)")  # fmt: skip


def test_a_budget_between_the_short_and_the_long_batch_stops_fit_whatever_the_first_batch(pretrained, mixed):
    """The budget check of ``fit`` predicts the long batches' peak even where the shuffle draws a short batch
    first: before, it passed such a run, which then met its long batches above the budget."""
    from lightning_helpers import quiet_trainer

    from pl_lowprec.models import CausalLM

    module = data(pretrained, mixed, 0)
    seed = next(s for s in range(20) if length(next(iter(data(pretrained, mixed, s).train_dataloader()))) < 64)
    short = next(iter(data(pretrained, mixed, seed).train_dataloader()))
    long, _ = sizing_batch(short, module)

    def peak(batch) -> int:
        return estimate_memory(lambda: CausalLM(str(pretrained)), batch, lora={"r": 4}).peak

    budget = (peak(short) + peak(long)) // 2
    strategy = LowPrecisionStrategy(lora={"r": 4}, memory_budget=budget)
    trainer = quiet_trainer(strategy=strategy, max_steps=1)
    with pytest.raises(ValueError, match=r"memory_budget=.*the predicted peak"):
        trainer.fit(CausalLM(str(pretrained)), datamodule=data(pretrained, mixed, seed))
    assert torch.equal(short["input_ids"], next(iter(data(pretrained, mixed, seed).train_dataloader()))["input_ids"])


def test_a_batch_of_features_is_said_by_its_tensor_shapes_not_as_rows_of_positions():
    """A tabular ``(x[4, 16], y[4])`` batch has no positions and no longer batch to come: it was said as "4 rows x
    16 positions" with a hint to add ``longest_train_row()``."""
    features = (torch.randn(4, 16), torch.zeros(4, dtype=torch.long))
    same, said = sizing_batch(features, None)
    assert same is features
    assert said == "the first training batch (4x16 float32, 4 int64)"
    tokens = {"input_ids": torch.zeros(4, 16, dtype=torch.long)}
    assert sizing_batch(tokens, None)[1].startswith("4 rows x 16 positions, the first training batch (the loaders")
