"""A Hugging Face model named by a local directory, or by a hub id where this machine has the network."""

from __future__ import annotations

from pathlib import Path

from pl_lowprec._error_text import briefly

# What a model repository needs here: config and tokenizer files, weights, and the chat template, which
# transformers >= 4.43 saves beside the tokenizer as chat_template.jinja (tokenizer_config.json no longer holds it).
HUB_FILES = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja"]
# Fetched only where a repository has no safetensors (as from_pretrained falls back to them): older checkpoints
# hold only pytorch_model.bin or its shards, and a repository with both would otherwise be downloaded twice.
BIN_FILES = ["pytorch_model*.bin"]
# huggingface_hub's own command line (``hf``; ``huggingface-cli`` is gone since huggingface_hub 1.0).
DOWNLOAD_COMMAND = "hf download"


def is_hub_id(name: str | Path) -> bool:
    """``org/name`` that is no local path: nothing there, and no local directory ``org`` (``runs/merged`` with a
    ``runs/`` here is a local path mistyped, not a repository)."""
    path = Path(name).expanduser()
    text = str(name)
    if path.exists() or text.startswith((".", "/", "~")) or text.count("/") != 1:
        return False
    return not path.parent.is_dir()


def resolve_pretrained(pretrained: str | Path, check_config: bool = True) -> Path:
    """A local model directory as is; a hub id downloaded (config, tokenizer, safetensors, else pytorch_model.bin)
    where there is network."""
    path = Path(pretrained).expanduser()
    if path.is_dir():
        if check_config and not (path / "config.json").is_file():
            raise ValueError(
                f"pretrained={str(pretrained)!r} has no config.json: it is not a Hugging Face model directory."
            )
        return path
    if not is_hub_id(pretrained):
        what = "is a file" if path.exists() else f"does not exist (relative to {Path.cwd()})"
        demo = (
            " The shipped configs' demo model is made once by `pl-lowprec make-demo-model runs/demo` (about a minute,"
            " nothing downloaded)."
            if path.parts[-2:] == ("demo", "model")
            else ""
        )
        raise ValueError(
            f"pretrained={str(pretrained)!r} is neither a model directory nor a hub id such as 'org/name': the path"
            f" {what}. Name a Hugging Face model directory (config.json and *.safetensors or pytorch_model.bin) or a"
            f" hub id.{demo}"
        )
    snapshot = hub_snapshot(str(pretrained), HUB_FILES, "pretrained=")
    if not any(snapshot.glob("*.safetensors")):
        snapshot = hub_snapshot(str(pretrained), BIN_FILES, "pretrained=")
    return snapshot


def hub_snapshot(hub_id: str, patterns: list[str], option: str) -> Path:
    """The files of ``hub_id`` that match ``patterns``, downloaded into the Hugging Face cache; one paragraph with
    the command to fetch them elsewhere where that fails (offline, unknown repo, gated)."""
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(hub_id, allow_patterns=patterns))
    except Exception as err:  # offline, unknown repo, gated model: every one needs the same advice
        raise ValueError(
            f"{option}{hub_id!r} is not a local directory, and downloading it from the Hugging Face Hub"
            f" failed ({briefly(err, 200)}). Download it on a machine with network access"
            f" (`{DOWNLOAD_COMMAND} {hub_id} --local-dir DIR`) and pass {option}DIR."
        ) from err


def local_or_downloaded(model: str, option: str = "--model") -> Path:
    """A command's model option: a local path as it is, else a hub id downloaded; the advice worded for the option."""
    local = Path(model).expanduser()
    if local.exists():
        return local
    try:
        return resolve_pretrained(model, check_config=False)
    except ValueError as err:
        raise ValueError(str(err).replace("pretrained=", f"{option} ")) from err


def hub_id_of(directory: str | Path | None) -> str | None:
    """The hub id of a snapshot in the Hugging Face cache (``.../models--org--name/snapshots/REV``), which is where
    a hub id's download lies; None for any other directory. The id is what others can load: the snapshot path is
    this machine's."""
    if directory is None:
        return None
    path = Path(directory).resolve()
    folder = path.parent.parent.name
    if path.parent.name != "snapshots" or not folder.startswith("models--"):
        return None
    return folder.removeprefix("models--").replace("--", "/")  # hub ids never hold "--"
