"""DDP's reducer holds gradient-sized buckets on every rank: the per-rank estimate adds them, checked against 2 real
gloo ranks through Lightning's fit loop. With the strategy's ``gradient_as_bucket_view=True`` the gradients are
views into those buckets: no second copy (each new gradient lives until DDP's hook copies it into its bucket)."""

import json
import sys
from pathlib import Path

import pytest
import torch
import warm_python

from pl_lowprec import LowPrecisionDDPStrategy, estimate_memory
from pl_lowprec.cli.estimate import estimate_arguments
from pl_lowprec.memory.collectives import gradient_as_bucket_view

SCRIPT = Path(__file__).parents[1] / "_scripts" / "ddp_peak.py"
sys.path.insert(0, str(SCRIPT.parent))
from ddp_peak import ROWS, SEQ, build  # noqa: E402

sys.path.remove(str(SCRIPT.parent))


def _estimate(world_size, view=False):
    batch = {"input_ids": torch.zeros(ROWS, SEQ, dtype=torch.long)}
    return estimate_memory(
        build, batch, precision="32-true", device="cpu", world_size=world_size, gradient_as_bucket_view=view
    )


def test_every_point_of_a_ddp_step_holds_the_buckets():
    one, two = _estimate(1), _estimate(2)
    buckets = two.gradients  # on a CPU, the buckets hold exactly the gradients' bytes
    assert [value - buckets for _, value in two.timeline] == [value for _, value in one.timeline]
    assert two.peak == one.peak + buckets and two.peak_split["ddp_buckets"] == buckets
    assert "per rank of 2" in two.table()


def test_with_gradient_as_bucket_view_the_buckets_are_the_gradients_only_copy():
    one, two, views = _estimate(1), _estimate(2), _estimate(2, view=True)
    buckets = views.gradients
    assert views.peak_split["ddp_buckets"] == buckets and views.peak_split["gradients"] == 0
    assert views.timeline[0] == one.timeline[0]  # the step starts with the last step's gradients: the buckets
    # the forward holds the buckets as the last step's gradients, and its peak is the single process's
    assert dict(views.timeline)["forward peak"] == dict(one.timeline)["forward peak"]
    assert one.peak < views.peak < two.peak  # each new gradient briefly beside the buckets, in the backward
    assert views.peak_phase == "backward" and two.peak - views.peak > buckets // 2


def test_the_estimate_reads_gradient_as_bucket_view_from_the_strategy():
    assert gradient_as_bucket_view(LowPrecisionDDPStrategy(gradient_as_bucket_view=True))
    assert not gradient_as_bucket_view(LowPrecisionDDPStrategy())
    assert not gradient_as_bucket_view("lowprec_ddp")
    config = str(Path(__file__).parents[2] / "configs" / "ddp.yaml")
    args = ["--config", config, "--trainer.accelerator=cpu"]
    assert not estimate_arguments(args)["gradient_as_bucket_view"]
    view = "--trainer.strategy.init_args.gradient_as_bucket_view=true"
    assert estimate_arguments([*args, view])["gradient_as_bucket_view"]


@pytest.mark.slow  # two processes, each a fit: 15-40 s
@pytest.mark.parametrize("view", [False, True], ids=["own-gradients", "gradient_as_bucket_view"])
def test_the_per_rank_estimate_is_the_measured_peak_of_two_gloo_ranks(tmp_path, view):
    command = [sys.executable, str(SCRIPT), str(tmp_path), *(["view"] if view else [])]
    result = warm_python.run(command, 300, ranks=2)
    assert result.returncode == 0, result.stderr[-4000:]
    measured = [json.loads((tmp_path / f"rank{rank}.json").read_text())["measured"] for rank in (0, 1)]
    estimate = _estimate(2, view)
    for peak in measured:  # both ranks: the script skips DDP's wrap-time broadcast (see its docstring)
        assert estimate.peak == pytest.approx(peak, rel=0.01), (estimate.peak, measured, estimate.table())
