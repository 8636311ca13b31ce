"""Every strategy shows its whole signature: its own arguments, the shared model arguments and Lightning's."""

import inspect

import pytest
from lightning.pytorch.strategies import DDPStrategy, SingleDeviceStrategy

from pl_lowprec import LowPrecisionDDPStrategy, LowPrecisionFSDPStrategy, LowPrecisionStrategy
from pl_lowprec.strategies.transform_args import TransformArguments

SHARED = {
    name: p.default
    for name, p in inspect.signature(TransformArguments.__init__).parameters.items()
    if p.kind is p.KEYWORD_ONLY
}


def test_the_shared_arguments_are_the_model_arguments():
    assert {"quantization", "lora", "activation_checkpointing", "optimizer", "pretrained", "compile"} <= set(SHARED)


@pytest.mark.parametrize("strategy", [LowPrecisionStrategy, LowPrecisionDDPStrategy, LowPrecisionFSDPStrategy])
def test_every_strategy_lists_the_shared_arguments_with_their_defaults(strategy):
    parameters = inspect.signature(strategy).parameters
    assert {name: parameters[name].default for name in SHARED if name in parameters} == SHARED
    assert all(parameters[name].kind is inspect.Parameter.KEYWORD_ONLY for name in SHARED)
    assert "memory_budget" in inspect.signature(strategy).__str__()


def test_each_strategy_lists_its_own_and_lightnings_arguments():
    single = inspect.signature(LowPrecisionStrategy).parameters
    assert next(iter(single)) == "device" and single["device"].default is None  # its own default, not Lightning's
    assert {"accelerator", "checkpoint_io", "precision_plugin"} <= set(single)
    assert "kwargs" not in single  # SingleDeviceStrategy takes nothing more

    ddp = inspect.signature(LowPrecisionDDPStrategy).parameters
    lightning_ddp = inspect.signature(DDPStrategy).parameters
    assert {n: p.default for n, p in lightning_ddp.items()} == {n: ddp[n].default for n in lightning_ddp}
    assert list(ddp)[-1] == "kwargs"  # DDP's own **kwargs go to DistributedDataParallel

    fsdp = inspect.signature(LowPrecisionFSDPStrategy).parameters
    assert list(fsdp)[:3] == ["shard_modules", "reshard_after_forward", "cpu_offload"]
    assert fsdp["nf4_scaler_block_size"].default == "auto"
    # set by the strategy itself for ModelParallelStrategy: passing them would give the base two values
    assert "data_parallel_size" not in fsdp and "save_distributed_checkpoint" not in fsdp
    assert "kwargs" not in fsdp


def test_the_signature_binds_what_the_class_accepts():
    signature = inspect.signature(LowPrecisionStrategy)
    arguments = {"device": "cpu", "quantization": "nf4", "checkpoint_io": None}
    signature.bind(**arguments)
    strategy = LowPrecisionStrategy(**arguments)
    assert strategy.transform_config.quantization.mode == "nf4"
    with pytest.raises(TypeError):
        signature.bind("cpu", "nf4")  # the model arguments are keyword-only, as the class takes them


def test_a_users_subclass_gets_its_own_whole_signature():
    class MyStrategy(LowPrecisionStrategy):
        def __init__(self, note: str = "", **kwargs):
            super().__init__(**kwargs)
            self.note = note

    parameters = inspect.signature(MyStrategy).parameters
    assert list(parameters)[:2] == ["note", "device"]
    assert set(SHARED) <= set(parameters)
    assert MyStrategy(note="x", lora={"r": 4}).note == "x"


def _documented_arguments(docstring: str) -> dict[str, str]:
    """``{argument: its first line of help}`` from a Google-style ``Args:`` section."""
    section = inspect.cleandoc(docstring).partition("Args:\n")[2]
    entries = (
        line.strip() for line in section.splitlines() if line.startswith("    ") and not line.startswith("     ")
    )
    return dict(entry.split(": ", 1) for entry in entries if ": " in entry)


@pytest.mark.parametrize("strategy", [LowPrecisionStrategy, LowPrecisionDDPStrategy, LowPrecisionFSDPStrategy])
def test_help_documents_the_shared_arguments_beside_the_strategys_own(strategy):
    import pydoc

    page = pydoc.render_doc(strategy, renderer=pydoc.plaintext)
    assert "quantization: 'QuantMode | QuantizationConfig | None' = None" in page
    documented = _documented_arguments(strategy.__doc__)
    shared = _documented_arguments(TransformArguments.__doc__)
    assert set(SHARED) <= set(shared)  # documented once, on TransformArguments
    assert {name: documented.get(name) for name in shared} == shared
    own = [p for p in inspect.signature(vars(strategy).get("__init__", object.__init__)).parameters]
    own = [name for name in own if name not in ("self", "args", "kwargs")]
    assert list(documented)[: len(own)] == own  # the strategy's own first, then the shared ones
    assert documented.get("**kwargs", "").count("quantization") == 0  # not "the model arguments, see elsewhere"


def test_a_users_subclass_documents_the_shared_arguments_once():
    class Documented(LowPrecisionStrategy):
        """Mine.

        Args:
            note: A note.
        """

        def __init__(self, note: str = "", **kwargs):
            super().__init__(**kwargs)

    class Undocumented(LowPrecisionStrategy):
        pass

    class Again(Documented):
        """Mine.

        Args:
            note: A note.
            quantization: Set by me.
        """

    documented = _documented_arguments(Documented.__doc__)
    assert list(documented)[:2] == ["note", "activation_checkpointing"] and "memory_budget" in documented
    assert Undocumented.__doc__ is None  # help() shows LowPrecisionStrategy's
    assert _documented_arguments(Again.__doc__)["quantization"] == "Set by me."
    assert issubclass(LowPrecisionStrategy, SingleDeviceStrategy)
