"""``plot_step``: the simulated step as stacked categories over time, the picture PyTorch's memory visualizer draws
from a CUDA snapshot, here drawn from the prediction (``pl-lowprec estimate --plot FILE.png``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pl_lowprec._imports import import_matplotlib_pyplot

STACK = ("weights", "gradients", "optimizer_state", "activations", "temporaries")
HELD_THROUGHOUT = ("ddp_buckets",)  # drawn where the estimate has them (``MemoryEstimate.add_held_throughout``)


def check_plot_path(path: str | Path) -> Path:
    """``path`` as a file the plot can be written to: its directory exists and it is no directory itself; else
    one paragraph saying what to do (checked before the estimate runs, not after)."""
    path = Path(path)
    directory = path.parent
    if not directory.is_dir():
        raise ValueError(
            f"--plot {str(path)!r}: the directory {str(directory)!r} does not exist, so the plot could not be"
            " written after the estimate. Create it (mkdir -p), or name a file in a directory that exists"
            " (--plot step.png)."
        )
    if path.is_dir():
        raise ValueError(f"--plot {str(path)!r} is a directory: name a file in it instead (--plot {path}/step.png).")
    return path


def plot_step(estimate: Any, path: str | Path) -> Path:
    """Write ``estimate``'s step (one point per allocating op) as a stacked area chart to ``path`` (PNG, SVG...)."""
    plt = import_matplotlib_pyplot()  # first: a missing matplotlib fails before any work
    path = check_plot_path(path)
    if not estimate.samples:
        raise ValueError("This estimate holds no samples of the step to plot (it was not simulated).")
    mib = 2**20
    stack = STACK + tuple(name for name in HELD_THROUGHOUT if estimate.samples[0][1].get(name))
    series = {name: [] for name in stack}
    for _, split in estimate.samples:
        for name in stack:
            extra = split.get("inputs", 0) if name == "activations" else 0  # the batch, with what forward makes
            series[name].append((split.get(name, 0) + extra) / mib)
    steps = range(len(estimate.samples))
    figure, axes = plt.subplots(figsize=(10, 4.5))
    axes.stackplot(steps, *series.values(), labels=[name.replace("_", " ") for name in stack])
    for index, phase in phase_starts(estimate.samples):
        if index:
            axes.axvline(index, color="grey", linewidth=0.6)
        axes.text(index, 0, f" {phase}", rotation=90, va="bottom", fontsize=7)
    shape = " (the step's shape drawn at 3 blocks; figures for all)" if estimate.extrapolated else ""
    repeated = estimate.repeated_micro_batches
    shape += f" ({repeated} more micro-batches as the last drawn)" if repeated else ""
    axes.set_title(f"Predicted peak {estimate.peak / mib:,.1f} MiB during the {estimate.peak_phase}{shape}")
    axes.set_xlabel("allocating op in the step")
    axes.set_ylabel("MiB live")
    axes.legend(loc="upper left", fontsize=8)
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)
    return path


def phase_starts(samples: list[tuple[str, Any]]) -> list[tuple[int, str]]:
    """``(sample index, phase)`` where each phase begins, the first (forward) included."""
    return [(i, name) for i, (name, _) in enumerate(samples) if i == 0 or samples[i - 1][0] != name]
