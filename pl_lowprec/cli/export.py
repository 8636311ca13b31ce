"""``pl-lowprec export``: a training checkpoint and its config to a peft adapter directory, a merged model or GGUF;
or a model directory to GGUF.

    pl-lowprec export --config configs/finetune-causal-lm.yaml --ckpt_path runs/.../last.ckpt --out runs/adapter
    pl-lowprec export --config ... --ckpt_path ... --out runs/merged --merged [--dtype float32]
    pl-lowprec export --config ... --ckpt_path ... --out runs/gguf --format gguf [--gguf_type q8_0]
    pl-lowprec export --model runs/merged --out runs/gguf --format gguf --gguf_type q4_k_m
    pl-lowprec export --ckpt_path runs/.../last.ckpt --out runs/adapter --push_to_hub me/my-adapter --private

Arguments the export does not know (``--model.pretrained DIR``, ``--trainer.accelerator cpu``) go to the config,
as for ``pl-lowprec fit``. Without ``--config``, the ``config.yaml`` LightningCLI saved next to the run's
``checkpoints/`` directory is used.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from pl_lowprec.adapters import check_adapter_fits_base, held_hf_model
from pl_lowprec.cli.own_options import check_own_options
from pl_lowprec.cli.rebuild import config_files, rebuild, with_config
from pl_lowprec.cli.resume import check_checkpoint
from pl_lowprec.cli.subcommands import subcommand_parser
from pl_lowprec.export.generates_text import GGUF, check_module_generates
from pl_lowprec.export.gguf_export import check_gguf_request, check_gguf_sources, convert_model_dir, export_gguf
from pl_lowprec.export.hub_push import check_push, push
from pl_lowprec.export.out_paths import check_out_dir
from pl_lowprec.export.quantized import check_qat_export, export_quantized
from pl_lowprec.export.restore import restore, sources
from pl_lowprec.export.write import check_dtype, check_export, choose_format, export, read_paths
from pl_lowprec.loading.sources import weight_files


def main(args: list[str] | None = None) -> None:
    parser = subcommand_parser("export", __doc__)
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--ckpt_path", help="A Lightning checkpoint (adapter-only or full).")
    source.add_argument(
        "--model",
        help="With --format gguf: a Hugging Face model directory to convert as it is (a --merged export, or any"
        " Llama, Mistral or Qwen2 model with its tokenizer) or a hub id, instead of a checkpoint.",
    )
    parser.add_argument("--out", required=True, help="The directory to write (must be empty, or --overwrite).")
    parser.add_argument("--merged", action="store_true", help="Merge into the original weights (default: adapter).")
    parser.add_argument("--dtype", default=None, help="Merged weights' dtype (default: the pretrained files').")
    parser.add_argument(
        "--format",
        default=None,
        help="adapter (the default), merged (as --merged), or gguf: the merged model for llama.cpp and Ollama.",
    )
    parser.add_argument(
        "--gguf_type",
        default=None,
        help="With --format gguf: auto (the default: bf16 or f16), bf16, f16, q8_0, q4_0, or one of"
        " llama-quantize's k-quant mixes, largest first: q6_k, q5_k_m, q5_k_s, q4_k_m (Ollama's default), q4_k_s,"
        " q3_k_l, q3_k_m, q3_k_s, q2_k. Several, comma-separated (q4_k_m,q8_0): a file each from one merge.",
    )
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help="Replace a previous export in --out (never a file read).",
    )
    parser.add_argument(
        "--push_to_hub",
        metavar="USER/NAME",
        help="Upload --out to this Hugging Face Hub model repository once written, with a model card (needs a"
        " token: hf auth login).",
    )
    parser.add_argument(
        "--private",
        action="store_true",
        help="With --push_to_hub: a new repository is private (an existing one keeps its visibility).",
    )
    parsed, cli_args = parser.parse_known_args(args)
    check_own_options(parser, cli_args, takes_overrides=parsed.model is None)
    check_push(parsed.push_to_hub, parsed.private)
    export_format = choose_format(parsed.format, parsed.merged, parsed.gguf_type)
    if export_format == "gguf":  # merged weights too, written in --gguf_type: no --dtype
        check_gguf_request(parsed.gguf_type, parsed.dtype)
    check_dtype(parsed.dtype, export_format == "merged")
    if parsed.model is not None:
        if export_format != "gguf":
            parser.error(
                f"--model converts a model directory to GGUF (--format gguf), and this export is --format"
                f" {export_format}: a peft adapter or a merged model comes from a training checkpoint (--ckpt_path)."
            )
        print(convert_model_dir(parsed.model, Path(parsed.out), parsed.gguf_type, parsed.overwrite))
        pushed(parsed, parsed.model)
        return
    checkpoint = Path(parsed.ckpt_path)
    check_checkpoint(checkpoint)
    cli_args = with_config(checkpoint, cli_args, parser)
    inputs, out = config_files(cli_args), Path(parsed.out)
    early = read_paths(checkpoint, None, None, inputs)
    check_out_dir(out, parsed.overwrite, early, pretrained_known=False)  # before the config is read
    run = rebuild(cli_args)  # the classes, nothing loaded: the rest is checked before the slow restore
    weights, tokenizer_dir = sources(run.trainer, run.model, run.datamodule)
    qat = getattr(getattr(run.trainer.strategy, "transform_config", None), "qat", None)
    if qat is not None:  # its export is the converted model (export/quantized.py)
        check_qat_export(export_format, "--merged" if parsed.merged else f"--format {export_format}")
    check_export(
        out,
        export_format != "adapter",
        parsed.dtype,
        parsed.overwrite,
        read_paths(checkpoint, weights, tokenizer_dir, inputs),
        weights,
        "--merged" if parsed.merged else f"--format {export_format}",
    )
    if export_format == "adapter" and qat is None:  # the strategy's LoRA config says it before the weights load
        check_adapter_fits_base(getattr(getattr(run.trainer.strategy, "transform_config", None), "lora", None))
    if export_format == "gguf":
        # a classifier built in __init__ is known before the weights load
        check_module_generates(held_hf_model(run.model), type(run.model).__name__, GGUF)
        check_gguf_sources(weights, tokenizer_dir)
    with weight_files():  # the restore's load and the merge read the base: a .bin shard is unpickled once
        restored = restore(checkpoint, run.trainer, run.model, run.datamodule, merge=export_format != "adapter")
        if qat is not None:
            print(export_quantized(restored, out, parsed.overwrite, inputs))
        elif export_format == "gguf":
            print(export_gguf(restored, out, parsed.gguf_type, parsed.overwrite, inputs))
        else:
            print(export(restored, out, export_format == "merged", parsed.dtype, parsed.overwrite, inputs))
    pushed(parsed, weights.path if weights is not None else None)


def pushed(parsed: argparse.Namespace, pretrained: str | Path | None) -> None:
    """With ``--push_to_hub``: the written ``--out`` uploaded, and the line that says where."""
    if parsed.push_to_hub is not None:
        print(push(Path(parsed.out), parsed.push_to_hub, parsed.private, pretrained))
