"""One search for the value a refusal's "did you mean" names (``pl_lowprec/_did_you_mean.py``), with each caller's
settings; no other module searches by spelling itself."""

from __future__ import annotations

from pathlib import Path

from pl_lowprec._did_you_mean import closest, did_you_mean
from pl_lowprec.plugins.amp import MIXED_SPELLINGS

PRECISIONS = ["auto", "16-mixed", "bf16-mixed"]


def test_case_then_other_spellings_then_the_nearest_by_spelling():
    precision = {"cutoff": 0.5, "spellings": MIXED_SPELLINGS, "ignore_case": True}  # the CLI's precision values
    assert closest("AUTO", PRECISIONS, **precision) == "auto"
    assert closest("FP16", PRECISIONS, **precision) == "16-mixed"
    assert closest("bf16-mix", PRECISIONS, **precision) == "bf16-mixed"
    assert closest("32-true", PRECISIONS, **precision) is None
    # AMPPrecision's: the same case and spellings, no search by spelling
    assert closest("bf16", PRECISIONS, cutoff=None, spellings=MIXED_SPELLINGS, ignore_case=True) == "bf16-mixed"
    assert closest("bf16-mix", PRECISIONS, cutoff=None, spellings=MIXED_SPELLINGS, ignore_case=True) is None
    # case matters unless ignored: difflib's own comparison, as subcommands and options have it
    assert closest("FIT", ["fit", "validate"]) is None and closest("fitt", ["fit", "validate"]) == "fit"
    assert closest("--overwrit", ["--overwrite", "--optimizer"], cutoff=0.8) == "--overwrite"
    assert closest("--optimizer", ["--overwrite"], cutoff=0.8) is None


def test_the_hint_ends_a_sentence_or_is_nothing():
    assert did_you_mean("16-mixed") == " Did you mean '16-mixed'?" and did_you_mean(None) == ""


def test_no_other_module_of_the_package_searches_by_spelling_itself():
    package = Path(__file__).parents[1] / "pl_lowprec"
    searching = sorted(
        str(path.relative_to(package))
        for path in package.rglob("*.py")
        if "get_close_matches" in path.read_text() or "import difflib" in path.read_text()
    )
    assert searching == ["_did_you_mean.py"]
