"""What ``measure_interconnect`` finds between 2 local processes (gloo on a CPU, NCCL where there are 2 GPUs):
each collective's bus bandwidth and the latency, as a run across ranks measures them before loading.

Run: python benchmarks/collective_bandwidth.py [--ranks 2]
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from pl_lowprec.memory.collectives import measure_interconnect


def _rank(rank: int, ranks: int, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    cuda = torch.cuda.device_count() >= ranks
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=ranks)
    try:
        link = measure_interconnect(device)
        if rank == 0:
            print(link.describe())
    finally:
        dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--port", type=int, default=29531)
    args = parser.parse_args()
    mp.start_processes(_rank, args=(args.ranks, args.port), nprocs=args.ranks, start_method="spawn")


if __name__ == "__main__":
    main()
