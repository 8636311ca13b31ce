"""The step-time prediction replayed on a GPU run's own figures: each contender's simulated kernels (``ops``, from
``gpu_peers.py --profile-step``) timed on the run's GPU with the launch overhead as shipped and as measured on
that run's host (``host_overhead.micro``), against the measured step, with the profiled step's kernels and busy
time beside the simulated ones.

python benchmarks/step_time_replay.py RESULTS.json [RESULTS.json ...]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from collections import Counter
from pathlib import Path
from typing import Any

from pl_lowprec.memory.devices import device_spec, gpu_named
from pl_lowprec.memory.op_counts import OpProfile
from pl_lowprec.memory.step_time import predict_step_time


def profile_of(row: dict[str, Any]) -> OpProfile:
    """The row's kernels; rows written before kernels had a kind (5 columns, not 6) hold no attention apart."""
    counts: Counter = Counter()
    for d, f, b, o, *kind, n in row["ops"]:
        counts[(d, f, b, bool(o), kind[0] if kind else "")] += n
    return OpProfile(counts, compiled=bool(row.get("ops_compiled")))


def replay(row: dict[str, Any], gpu: str) -> dict[str, Any]:
    spec = device_spec(gpu_named(gpu) or "H100")
    profile = profile_of(row)
    figures: dict[str, Any] = {"shipped": predict_step_time(profile, spec).seconds}
    for name, seconds in (row.get("host") or {}).items():
        figures[f"L={name}"] = predict_step_time(profile, dataclasses.replace(spec, launch_overhead=seconds)).seconds
    device_only = predict_step_time(profile, dataclasses.replace(spec, launch_overhead=0.0))
    figures["device_only"] = device_only.seconds
    figures["launches"] = profile.launches
    return figures


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", nargs="+", type=Path)
    args = parser.parse_args(argv)
    for path in args.results:
        data = json.loads(path.read_text())
        print(f"# {path} on {data['gpu']}")
        for row in data["rows"]:
            if not row.get("ops"):
                continue
            figures = replay(row, data["gpu"])
            profiled = row.get("step_profile") or {}
            host = {k: f"{v * 1e6:.1f} us" for k, v in (row.get("host") or {}).items()}
            print(
                f"{row['model']} {row['contender']}: measured {row['step_s']:.3f} s; "
                + ", ".join(f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}" for k, v in figures.items())
                + f"; profiled {profiled}; host {host}"
            )


if __name__ == "__main__":
    main()
