"""How often a 2-rank gloo process aborts at exit ("terminate called without an active exception"), with and
without ``pl_lowprec.distributed.process_group_exit``'s cleanup.

Run: python benchmarks/gloo_exit_race.py [--runs 24]

Each run starts 2 ranks with ``torchrun`` (gloo on the CPU); they ``broadcast_object_list`` three times, as
Lightning's ``strategy.broadcast`` does near the end of a fit, and exit at once. An object that holds the process
group in a reference cycle stands in for FSDP2's states. Variants, each at exit:

- ``destroy``: ``destroy_process_group()`` only (what the strategies did before);
- ``destroy+collect``: then ``gc.collect()``, which frees the cycle, so the group's destructor joins gloo's threads
  (what ``process_group_exit`` does);
- ``destroy+collect, group held``: the same with the group also held by a live global, which no collection frees.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

from common import describe_machine, machine_info, markdown_table, section, write_json

RANK_SCRIPT = """
import atexit, gc, sys
import torch.distributed as dist

variant = sys.argv[1]
dist.init_process_group("gloo")


def at_exit():
    dist.destroy_process_group()
    if variant != "destroy":
        gc.collect()


atexit.register(at_exit)


class Holder:
    pass


holder = Holder()
holder.group = dist.group.WORLD
if variant != "held":
    holder.cycle = holder
    del holder
for _ in range(3):
    objects = [{"x": list(range(1000))}] if dist.get_rank() == 0 else [None]
    dist.broadcast_object_list(objects, src=0)
"""

VARIANTS = {"destroy": "destroy", "destroy+collect": "collect", "destroy+collect, group held": "held"}


def aborted(script: Path, variant: str, port: int) -> bool:
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(port)]
    done = subprocess.run([*command, str(script), variant], capture_output=True, text=True, timeout=120)
    return "terminate called" in done.stdout + done.stderr


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=24)
    args = parser.parse_args()
    section("gloo exit race: aborted runs of 2 ranks")
    with tempfile.TemporaryDirectory() as folder:
        script = Path(folder) / "rank.py"
        script.write_text(RANK_SCRIPT)
        counts = {
            name: sum(aborted(script, variant, 29900 + run) for run in range(args.runs))
            for name, variant in VARIANTS.items()
        }
    info = machine_info()
    print(describe_machine(info))
    print(markdown_table(["at exit", "aborted runs"], [[name, f"{n} of {args.runs}"] for name, n in counts.items()]))
    write_json("gloo_exit_race", {"machine": info, "runs": args.runs, "aborted": counts})


if __name__ == "__main__":
    main()
