"""The model summary counts a 4-bit weight at its logical shape and sizes the model by its stored bytes."""

import warnings

import pytest
from lightning.pytorch.callbacks import ModelSummary, RichModelSummary
from lightning_helpers import quiet_trainer
from qlora_helpers import ids_loader, tiny_llama

from pl_lowprec import LowPrecisionStrategy
from pl_lowprec.callbacks import LowPrecisionModelSummary, LowPrecisionRichModelSummary
from pl_lowprec.memory.breakdown import parameter_bytes

pytest.importorskip("bitsandbytes")
pytest.importorskip("peft")


class RecordingSummary(LowPrecisionModelSummary):
    def summarize(self, summary_data, total_parameters, trainable_parameters, model_size, *args, **kwargs):
        self.figures = (total_parameters, trainable_parameters, model_size)


def test_quantized_model_is_counted_at_its_logical_size():
    model = tiny_llama()
    unquantized = sum(p.numel() for p in model.parameters())
    summary = RecordingSummary()
    strategy = LowPrecisionStrategy(quantization="nf4-dq", lora={"r": 4, "lora_alpha": 8})
    trainer = quiet_trainer(max_steps=1, strategy=strategy, callbacks=[summary], enable_model_summary=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(model, ids_loader(batches=1))
    total, trainable, size_mb = summary.figures

    adapters = sum(p.numel() for name, p in model.named_parameters() if "lora_" in name)
    assert adapters > 0 and trainable == sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert total == unquantized + adapters  # each nf4 weight once, unpacked
    stored = sum(parameter_bytes(model).values())
    assert size_mb == pytest.approx(stored * 1e-6)
    packed = sum(p.untyped_storage().nbytes() for p in model.parameters())
    assert stored > packed  # the quantization constants (absmax, code books) are in the size
    assert not [w for w in caught if "not supported by the model summary" in str(w.message)]


def test_only_lightnings_default_summary_is_swapped(tmp_path):
    from pl_lowprec.callbacks.model_summary import use_true_size_model_summary

    class Own(ModelSummary):
        pass

    trainer = quiet_trainer(callbacks=[RichModelSummary(max_depth=2), ModelSummary(), Own()])
    use_true_size_model_summary(trainer)
    summaries = [c for c in trainer.callbacks if isinstance(c, ModelSummary)]
    assert [type(c) for c in summaries] == [LowPrecisionRichModelSummary, LowPrecisionModelSummary, Own]
    assert summaries[0]._max_depth == 2


def test_sharded_parameters_are_summed_over_the_ranks_and_replicated_ones_are_not(tmp_path):
    """Under FSDP2 each rank holds a shard: the model's size is their sum (one collective on every rank); under
    DDP each rank holds the whole model."""
    from types import SimpleNamespace

    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    from pl_lowprec.callbacks.model_summary import held_parameter_bytes

    reduced = []

    def reduce(tensor, reduce_op):
        reduced.append(reduce_op)
        return tensor * 2  # what the other rank's equal shard adds

    trainer = SimpleNamespace(world_size=2, strategy=SimpleNamespace(reduce=reduce, root_device=torch.device("cpu")))
    replicated = torch.nn.Linear(8, 4, bias=False)
    assert held_parameter_bytes(trainer, replicated) == 8 * 4 * 4 and not reduced
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        sharded = torch.nn.Linear(8, 4, bias=False)
        sharded.weight = torch.nn.Parameter(DTensor.from_local(torch.zeros(4, 8), mesh, [Shard(0)]))
        assert held_parameter_bytes(trainer, sharded) == 2 * 8 * 4 * 4 and reduced == ["sum"]
    finally:
        dist.destroy_process_group()


def test_a_plain_trainer_with_the_strategy_prints_the_true_size(capsys):
    trainer = quiet_trainer(max_steps=1, strategy=LowPrecisionStrategy(quantization="nf4"), enable_model_summary=True)
    model = tiny_llama()
    trainer.fit(model, ids_loader(batches=1))
    summaries = [c for c in trainer.callbacks if isinstance(c, ModelSummary)]
    assert [type(c).__name__ for c in summaries] in (["LowPrecisionRichModelSummary"], ["LowPrecisionModelSummary"])
    held_mb = sum(parameter_bytes(model).values()) * 1e-6
    assert f"Total estimated model params size (MB): {held_mb:.3f}" in capsys.readouterr().out
