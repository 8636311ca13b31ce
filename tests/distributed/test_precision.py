"""Which precision plugins strategy="lowprec_fsdp" runs: a plugin's own declaration, else Lightning's as data."""

import pytest
from lightning.pytorch.plugins.precision import DoublePrecision, FSDPPrecision, HalfPrecision, MixedPrecision, Precision

from pl_lowprec import AMPPrecision
from pl_lowprec.distributed.precision import SUPPORTED_PRECISIONS, check_precision, supports_fsdp2


@pytest.mark.parametrize(
    "plugin",
    [Precision(), HalfPrecision("bf16-true"), MixedPrecision("bf16-mixed", "cpu"), AMPPrecision("auto")],
    ids=["Precision", "HalfPrecision-bf16-true", "MixedPrecision-bf16-mixed", "AMPPrecision-auto"],
)
def test_runs(plugin):
    assert supports_fsdp2(plugin)
    check_precision(plugin)


@pytest.mark.parametrize(
    ("plugin", "named"),
    [
        (HalfPrecision("16-true"), "HalfPrecision('16-true')"),
        (MixedPrecision("16-mixed", "cpu"), "MixedPrecision('16-mixed')"),
        (DoublePrecision(), "DoublePrecision('64-true')"),  # a subclass of Precision is not Precision
        (FSDPPrecision("bf16-mixed"), "FSDPPrecision('bf16-mixed')"),  # nor is FSDP1's plugin MixedPrecision
    ],
)
def test_refused_naming_the_plugin_and_what_runs(plugin, named):
    with pytest.raises(ValueError, match="cannot run") as error:
        check_precision(plugin)
    message = str(error.value)
    assert named in message
    assert all(supported in message for supported in SUPPORTED_PRECISIONS)


class DeclaresNothing(AMPPrecision):
    supports_fsdp2 = None  # falls back to the table, which lists no such class


class RefusesSharding(AMPPrecision):
    supports_fsdp2 = False


class CustomBf16(Precision):
    precision = "bf16-true"
    supports_fsdp2 = True


def test_a_plugin_says_for_itself():
    assert supports_fsdp2(AMPPrecision("16-mixed"))
    assert not supports_fsdp2(RefusesSharding("16-mixed"))
    assert not supports_fsdp2(DeclaresNothing("bf16-mixed"))
    assert supports_fsdp2(CustomBf16())
