"""``pl-lowprec test`` and ``predict`` on data without the loader (``TextDataModule`` has no test or predict loader)
are refused before the model is built or a weight loads: Lightning checks the loader only once the run has started,
after the pretrained weights streamed in and the checkpoint was restored, minutes for a large model.

The guards of that check are the predict case and the ``test`` case of a module that has a ``test_step``: both
built the model before the refusal without it. ``test`` on ``CausalLM`` (no ``test_step``) is refused before the
model by Lightning's own check; its case guards only the paragraph. The commands run in-process, the user's way
(``pl_lowprec.cli.main``); building the model fails the test.
"""

from __future__ import annotations

import pytest
from gguf_helpers import fail_if_called
from loading_helpers import causal_lm_fit_args, save_pretrained_dir, write_prompt_completion
from own_module_helpers import write_own_module

from pl_lowprec.cli import main

pytest.importorskip("transformers")

WITH_TEST_STEP = """
from pl_lowprec.models import CausalLM


class ScoredLM(CausalLM):
    def test_step(self, batch, batch_idx):
        return self.validation_step(batch, batch_idx)
"""

CASES = [  # (subcommand, the model's class, what the paragraph says)
    (
        "predict",
        "pl_lowprec.models.CausalLM",
        "`predict_dataloader` must be implemented to be used with the Lightning Trainer. For the loss",
    ),
    (
        "test",
        "scored.ScoredLM",
        "`test_dataloader` must be implemented to be used with the Lightning Trainer. For the loss",
    ),
    (  # Lightning's own refusal, before the model is built with or without the package's check
        "test",
        "pl_lowprec.models.CausalLM",
        "No `test_step()` method defined to run `Trainer.test`. For the loss and perplexity",
    ),
]


@pytest.fixture(scope="module")
def user_files(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("missing_loop")
    return save_pretrained_dir(tmp / "model"), write_prompt_completion(tmp / "pc.jsonl", 8)


@pytest.mark.parametrize(("subcommand", "model", "said"), CASES, ids=["predict", "test-loader", "test-step"])
def test_a_missing_loader_is_refused_before_the_model_is_built(
    capsys, monkeypatch, tmp_path, user_files, subcommand, model, said
):
    write_own_module(tmp_path, "scored", WITH_TEST_STEP, monkeypatch)
    fail_if_called(monkeypatch, ["pl_lowprec.models.CausalLM.configure_model"], "the model was built")
    args = [arg for arg in causal_lm_fit_args(*user_files)[1:] if not arg.startswith("--model=")]
    with pytest.raises(SystemExit) as exited:
        main([subcommand, f"--model={model}", *args, f"--trainer.default_root_dir={tmp_path}"])
    out, err = capsys.readouterr()
    assert exited.value.code == 2, (out + err)[-3000:]
    assert "Traceback" not in out + err
    paragraph = next(line for line in err.splitlines() if "error: " in line)
    assert f"{subcommand} stopped before its first step: {said}" in paragraph, paragraph
    assert "`pl-lowprec generate --ckpt_path CKPT" in paragraph
