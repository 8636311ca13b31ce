"""The measured peak of step 3 of a tiny Llama's full fine-tune on 2 DDP gloo processes, through Lightning's fit
loop (``fit_peak_helpers.measured_fit_peak``: the profiler from before the module is built); each rank writes
OUT_DIR/rank{N}.json. Run by tests/memory/test_ddp_buckets.py; Lightning's DDP launcher re-runs it for rank 1.
With ``view``, DDP runs with ``gradient_as_bucket_view=True`` (the gradients are views into its buckets).

``init_sync=False``: both ranks build the same seeded weights, so DDP's wrap-time broadcast of rank 0's weights has
nothing to do, and it would blur the measurement: its flat buffer (the parameters' bytes, from
``aten::flatten_dense_tensors``) is now and then freed on gloo's worker thread, where the profiler records no free,
so the buffer seemed to stay live through the step on that rank (seen on either rank, 1 run in 4).

Usage: python ddp_peak.py OUT_DIR [view]
"""

import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parents[1]))  # tests/: the shared helpers

from fit_peak_helpers import ids_loader, measured_fit_peak

from pl_lowprec import LowPrecisionDDPStrategy
from pl_lowprec.demo import TinyLlama

SIZES = {"hidden_size": 128, "intermediate_size": 256, "num_layers": 2, "max_len": 16}
ROWS, SEQ = 2, 16  # per rank


def build() -> TinyLlama:
    return TinyLlama(**SIZES)


def main(out: str, view: str = "") -> None:
    torch.set_num_threads(1)
    loader = ids_loader(8, ROWS, SEQ)
    strategy = LowPrecisionDDPStrategy(
        process_group_backend="gloo", gradient_as_bucket_view=view == "view", init_sync=False
    )
    peak = measured_fit_peak(build, loader, strategy=strategy, devices=2)
    rank = int(os.environ.get("LOCAL_RANK", 0))
    (Path(out) / f"rank{rank}.json").write_text(json.dumps({"measured": peak}))


if __name__ == "__main__":
    main(*sys.argv[1:])
