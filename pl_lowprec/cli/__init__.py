"""``pl-lowprec`` / ``python -m pl_lowprec``: LightningCLI with this package's plugins, strategies and callbacks,
and the subcommands ``export``, ``generate``, ``estimate`` and ``make-demo-model``.

- ``dispatch``: the console script, a table from subcommand to its ``main``;
- ``lightning_cli``: ``LowPrecisionCLI`` and ``build_cli`` (``fit``, ``validate``, ``test``, ``predict``), with
  ``config_errors`` (one-paragraph refusals) and ``resume`` (``--ckpt_path`` checks);
- ``rebuild``: a run rebuilt from its config as ``fit`` builds it, without running (for the subcommands);
- ``export``, ``generate``, ``estimate``, ``make_demo_model``: each subcommand's arguments; the work itself is
  done in ``pl_lowprec.export``, ``pl_lowprec.memory`` and ``pl_lowprec.demo``.
"""

from pl_lowprec.cli.dispatch import main
from pl_lowprec.cli.lightning_cli import LowPrecisionCLI, build_cli

__all__ = ["LowPrecisionCLI", "build_cli", "main"]
