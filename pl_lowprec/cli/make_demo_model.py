"""``pl-lowprec make-demo-model OUT_DIR``: the demo's pretrained model and task (``pl_lowprec.demo.pretrained``)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from pl_lowprec._checks import int_at_least
from pl_lowprec.cli.subcommands import description
from pl_lowprec.demo.pretrained import check_out_dir, make_demo_model


def main(args: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="pl-lowprec make-demo-model", description=description("make-demo-model"))
    parser.add_argument("out_dir", help="Writes OUT_DIR/model (Hugging Face directory) and OUT_DIR/data.")
    parser.add_argument(
        "--steps", type=int_at_least(1), default=300, help="Pre-training steps (300: about a minute on 2 cores)."
    )
    parser.add_argument("--overwrite", action="store_true", help="Replace an earlier demo in OUT_DIR.")
    parsed = parser.parse_args(args)
    try:
        check_out_dir(Path(parsed.out_dir), parsed.overwrite)
    except ValueError as err:
        parser.exit(2, f"{parser.prog}: error: {err}\n")
    model_dir = make_demo_model(
        parsed.out_dir, steps=parsed.steps, overwrite=parsed.overwrite, progress=lambda line: print(line, flush=True)
    )
    summary = json.loads((model_dir / "pretraining.json").read_text())
    print(
        f"Wrote {model_dir} ({summary['parameters']:,} parameters; loss {summary['first_loss']:.2f} ->"
        f" {summary['last_loss']:.2f} in {summary['seconds']} s) and {Path(parsed.out_dir) / 'data'}."
    )
