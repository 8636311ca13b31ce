"""With only the core dependencies (torch, lightning), the package imports and AMP trains; each extra's feature
fails when asked for, with its install command."""

import logging
import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent(
    """
    import importlib.abc, sys, warnings

    # yaml is a lightning dependency
    BLOCKED = {"bitsandbytes", "peft", "safetensors", "transformers", "jsonargparse", "torchao", "datasets"}

    class Block(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in BLOCKED:
                raise ModuleNotFoundError(f"No module named {name!r}")
            return None

    sys.meta_path.insert(0, Block())
    from lightning_utilities.core import imports
    available = imports.RequirementCache.__bool__
    imports.RequirementCache.__bool__ = lambda self: (
        available(self) and self.requirement.split("[")[0].split(">")[0] not in BLOCKED
    )

    import torch, lightning.pytorch as pl
    import pl_lowprec
    import pl_lowprec.demo
    from pl_lowprec import AMPPrecision, LowPrecisionStrategy

    warnings.filterwarnings("ignore")
    model = pl_lowprec.demo.TinyGPT(dim=16, layers=1, heads=2)
    ids = torch.randint(0, 256, (8, 17))
    loader = torch.utils.data.DataLoader([{"input_ids": r} for r in ids], batch_size=4)
    trainer = pl.Trainer(accelerator="cpu", max_steps=2, plugins=[AMPPrecision("16-mixed")], logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         strategy=LowPrecisionStrategy(activation_checkpointing=["Block"]))
    trainer.fit(model, loader)
    print("trained", trainer.global_step)
    for kwargs in ({"quantization": "nf4"}, {"lora": {"r": 4}}, {"qat": "int4-weight-only"}, {"fp8": "rowwise"}):
        try:
            LowPrecisionStrategy(**kwargs)
        except ModuleNotFoundError as err:
            print("refused:", err)
    try:
        pl_lowprec.demo.TinyLlama()
    except ModuleNotFoundError as err:
        print("refused:", err)
    import tempfile, pathlib
    from pl_lowprec.data import TextDataModule
    parquet = pathlib.Path(tempfile.mkdtemp()) / "train.parquet"
    parquet.write_bytes(b"")
    try:
        TextDataModule(train_files=str(parquet), tokenizer="unused")
    except ModuleNotFoundError as err:
        print("refused:", err)
    """
)


def test_core_install_imports_trains_and_names_the_extras():
    result = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    out = result.stdout
    assert "trained 2" in out
    assert (
        "quantization= and the 8-bit optimizers need bitsandbytes" in out and 'pip install "pl_lowprec[qlora]"' in out
    )
    assert "lora= needs peft" in out
    assert out.count("qat= and fp8= need torchao") == 2 and 'pip install "pl_lowprec[torchao]"' in out
    assert "TinyLlama needs transformers" in out and 'pip install "pl_lowprec[hf]"' in out
    assert "TextDataModule reads .parquet, .csv, .json and .arrow files" in out
    assert 'pip install "pl_lowprec[datasets]"' in out


def test_torchao_and_bitsandbytes_import_without_their_noise_on_a_cpu_machine():
    """torchao 0.18's wheel logs 'Failed to load ..._C_cutlass_90a.abi3.so' without a CUDA driver, and torch 2.13
    logs an Enum deprecation for it; transformers imports torchao whenever it is installed. bitsandbytes 0.50, on a
    CPU with avx512_bf16, logs 'Failed to load CPU gemm_4bit_forward from kernels-community' (an optional Hub
    kernel; its own runs instead). None of them reaches users."""
    script = (
        "import pl_lowprec, pl_lowprec.demo; pl_lowprec.demo.TinyLlama(hidden_size=32, num_layers=1, num_heads=2)\n"
        "from pl_lowprec._imports import import_torchao, import_bitsandbytes; import_torchao(); import_bitsandbytes()\n"
        "import sys; print('torchao' in sys.modules, 'bitsandbytes' in sys.modules)"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip() == "True True"
    assert "Failed to load" not in result.stderr and "Enum subclass" not in result.stderr, result.stderr


def test_only_the_hub_kernel_notice_of_bitsandbytes_is_dropped(caplog):
    """The same filter on any CPU (bitsandbytes logs the notice only where it finds avx512_bf16): its other
    warnings still reach the user."""
    import pl_lowprec  # noqa: F401  (installs the filters)

    logger = logging.getLogger("bitsandbytes.backends.cpu.ops")
    with caplog.at_level(logging.WARNING, logger=logger.name):
        logger.warning(
            "Failed to load CPU gemm_4bit_forward from kernels-community: %s. Please make sure you already `pip"
            " install kernels` and the kernels >= 0.11.1",
            "No module named 'kernels'",
        )
        logger.warning("Failed to load the CPU library")
    assert [record.getMessage() for record in caplog.records] == ["Failed to load the CPU library"]
