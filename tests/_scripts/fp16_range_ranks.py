"""Cast a frozen embedding's rows, split over 2 gloo ranks, to float16; one value beyond float16's range sits in
rank 0's rows only.

Usage: python fp16_range_ranks.py OUT_DIR   Writes OUT_DIR/rank{N}.txt: the refusal's message, or "cast" when the
rank cast without one. Run by tests/transforms/test_frozen_dtype.py: every rank must refuse, or the one that did
not would wait in FSDP2's next collective for the one that stopped.
"""

import os
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from pl_lowprec.distributed.mesh import local_rows
from pl_lowprec.transforms.frozen_dtype import cast_frozen_weights


def main(out: Path) -> None:
    rank = int(os.environ["LOCAL_RANK"])
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=timedelta(seconds=60))
    try:
        mesh = init_device_mesh("cpu", (2,))
        embedding = torch.nn.Embedding(4, 8)  # rows 0-1 on rank 0, rows 2-3 on rank 1
        with torch.no_grad():
            embedding.weight[1, 2] = 1e6
        embedding.weight = torch.nn.Parameter(local_rows(embedding.weight.detach(), mesh), requires_grad=False)
        try:
            cast_frozen_weights(torch.nn.Sequential(embedding), torch.float16)
            said = "cast"
        except ValueError as error:
            said = str(error)
        (out / f"rank{rank}.txt").write_text(said)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
