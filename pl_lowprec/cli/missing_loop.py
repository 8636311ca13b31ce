"""``pl-lowprec test`` and ``predict`` of data without the loader (``TextDataModule`` has no test or predict
loader), refused before anything loads; and the paragraph for a module without the step (``CausalLM`` has no
``test_step``).

Lightning checks the step itself before the model is built (``_verify_loop_configurations``), but the loader only
once the run has started: the pretrained weights streamed in and quantized, and the ``--ckpt_path`` restored, which
for a large model takes minutes. The loader check runs here first, on the classes the config built, with
Lightning's wording; ``missing_loop_paragraph`` adds the commands that do what the user likely wants.
"""

from __future__ import annotations

from typing import Any

from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch.utilities.model_helpers import is_overridden

from pl_lowprec.cli.config_errors import first_paragraph


def check_loop_defined(subcommand: str, model: Any, datamodule: Any) -> None:
    """``MisconfigurationException`` in Lightning's words where ``test``/``predict`` lacks the loader of the data
    module (or, without one, of the module). A missing ``test_step`` is left to
    Lightning's own check (before the model is built), which names it rather than the loader."""
    if subcommand not in ("test", "predict"):
        return
    if subcommand == "test" and not is_overridden("test_step", model):
        return  # Lightning refuses a missing step itself, in its words, before the model is built: the first fault
    loader = f"{subcommand}_dataloader"
    if not is_overridden(loader, datamodule if datamodule is not None else model):
        raise MisconfigurationException(f"`{loader}` must be implemented to be used with the Lightning Trainer.")


def missing_loop_paragraph(subcommand: str, err: BaseException) -> str | None:
    """Lightning's refusal of ``test``/``predict`` for a module without the step or data without the loader (as
    ``CausalLM`` and ``TextDataModule`` have none), with the commands that do what the user likely wants."""
    text = first_paragraph(str(err))
    missing = f"`{subcommand}_step()`" in text or f"`{subcommand}_dataloader` must be implemented" in text
    if subcommand not in ("test", "predict") or not isinstance(err, MisconfigurationException) or not missing:
        return None
    return (
        f"{text.rstrip('.')}. For the loss and perplexity of held-out files, run the same command as `pl-lowprec"
        " validate` (the same --config and --ckpt_path; add --data.val_files FILE to score other files than the"
        " config's); for completions of a file of prompts, `pl-lowprec generate --ckpt_path CKPT --prompts FILE"
        " --out OUT.jsonl`."
    )
