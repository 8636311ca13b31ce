"""``pl-lowprec --version`` prints this package's version and those of torch, lightning, transformers and the other
libraries a run depends on, exit status 0, as ``accelerate env`` does for a bug report. LightningCLI has no
``--version``: it was refused as "unrecognized arguments", exit status 2."""

from __future__ import annotations

from importlib.metadata import version

import torch

import pl_lowprec
from pl_lowprec.cli import main


def test_version_prints_the_package_and_its_libraries(capsys):
    main(["--version"])  # returns: exit status 0
    out, err = capsys.readouterr()
    lines = out.splitlines()
    assert lines[0] == f"pl_lowprec {pl_lowprec.__version__}"
    assert any(line.startswith(f"torch {torch.__version__} (") for line in lines), out
    for name in ("lightning", "transformers", "peft", "bitsandbytes", "torchao"):
        assert f"{name} {version(name)}" in lines, out
    assert "Traceback" not in err


def test_the_help_names_version(capsys):
    try:
        main(["--help"])
    except SystemExit as exited:
        assert exited.code == 0
    assert "`pl-lowprec --version` prints its version" in " ".join(capsys.readouterr().out.split())
