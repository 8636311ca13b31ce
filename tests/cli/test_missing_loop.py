"""``pl-lowprec test`` and ``predict`` on a module without the step or data without the loader (``CausalLM``,
``TextDataModule``) are refused before the model is built or a weight loads: Lightning found out only once the
pretrained weights had streamed in and the checkpoint was restored, minutes for a large model.

The commands run in-process, the user's way (``pl_lowprec.cli.main``); building the model fails the test.
"""

from __future__ import annotations

import pytest
from gguf_helpers import fail_if_called
from loading_helpers import causal_lm_fit_args, save_pretrained_dir, write_prompt_completion

from pl_lowprec.cli import main

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def user_files(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("missing_loop")
    return save_pretrained_dir(tmp / "model"), write_prompt_completion(tmp / "pc.jsonl", 8)


@pytest.mark.parametrize(
    ("subcommand", "said"),
    [
        ("test", "No `test_step()` method defined to run `Trainer.test`. For the loss and perplexity"),
        ("predict", "`predict_dataloader` must be implemented to be used with the Lightning Trainer. For the loss"),
    ],
)
def test_a_missing_step_or_loader_is_refused_before_the_model_is_built(
    capsys, monkeypatch, tmp_path, user_files, subcommand, said
):
    fail_if_called(monkeypatch, ["pl_lowprec.models.CausalLM.configure_model"], "the model was built")
    args = causal_lm_fit_args(*user_files)[1:]
    with pytest.raises(SystemExit) as exited:
        main([subcommand, *args, f"--trainer.default_root_dir={tmp_path}"])
    out, err = capsys.readouterr()
    assert exited.value.code == 2, (out + err)[-3000:]
    assert "Traceback" not in out + err
    paragraph = next(line for line in err.splitlines() if "error: " in line)
    assert f"{subcommand} stopped before its first step: {said}" in paragraph, paragraph
    assert "`pl-lowprec generate --ckpt_path CKPT" in paragraph
