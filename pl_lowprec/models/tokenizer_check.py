"""The data's tokenizer against the model, before step 0.

A token id at or past the embedding's rows fails inside step 1 (``IndexError``), and a tokenizer of another
model trains without an error on ids that mean other tokens to this model (the loss starts far above the
model's). Fewer tokens than rows is normal (Qwen pads its embedding to a multiple of 64), so the size alone
decides nothing: every id the tokenizer can produce must have a row, and where the model directory carries its
own tokenizer, each id the data's tokenizer shares with it must name the same token.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pl_lowprec.loading.tokenizer import load_tokenizer


def embedding_rows(config: Any) -> int:
    """The rows of the input embedding: ``vocab_size`` of the (text) config."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return int(text.vocab_size)


def out_of_range_ids(tokenizer: Any, rows: int) -> dict[str, int]:
    """Tokens (special ones included) whose id has no embedding row."""
    found = {token: i for token, i in tokenizer.get_vocab().items() if i >= rows}
    for name in ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id"):
        value = getattr(tokenizer, name, None)
        if value is not None and value >= rows:
            found[name] = value
    return found


def renamed_ids(tokenizer: Any, own: Any) -> list[tuple[int, str, str]]:
    """``(id, data token, model token)`` where the model's own tokenizer gives the id to another token."""
    own_by_id = {i: token for token, i in own.get_vocab().items()}
    return sorted(
        (i, token, own_by_id[i])
        for token, i in tokenizer.get_vocab().items()
        if i in own_by_id and own_by_id[i] != token
    )


def check_tokenizer(tokenizer: Any, source: str | None, config: Any, model_dir: Path | None) -> None:
    """``ValueError`` when ``tokenizer`` (from ``source``) would feed the model ids it has no row for, or ids that
    mean other tokens than to the tokenizer saved with the model in ``model_dir``."""
    rows = embedding_rows(config)
    where = f"--data.tokenizer {source!r}" if source else "The data's tokenizer"
    own = source is not None and model_dir is not None and Path(source).expanduser().resolve() == model_dir.resolve()
    named = f" (--data.tokenizer {str(model_dir)!r})" if model_dir is not None else ""
    missing = out_of_range_ids(tokenizer, rows)
    if missing:
        shown = ", ".join(f"{k!r}: {v}" for k, v in sorted(missing.items(), key=lambda kv: kv[1])[:5])
        fix = (
            f"It is the model directory's own, as transformers loads it (the tokenizer class follows the config's"
            f" model_type, which can add tokens the embedding lacks): use a tokenizer whose ids all stay below {rows}."
            if own
            else f"Use the model's own tokenizer{named}, or one whose ids all stay below {rows}."
        )
        raise ValueError(
            f"{where} has {len(tokenizer)} tokens with ids up to {max(missing.values())}, but the model has"
            f" {rows} embedding rows (config vocab_size): {len(missing)} ids have no row ({shown}) and would fail"
            f" in step 1. {fix}"
        )
    if own or model_dir is None or not (model_dir / "tokenizer_config.json").is_file():
        return
    renamed = renamed_ids(tokenizer, load_tokenizer(model_dir))
    if renamed:
        shown = ", ".join(f"{i}: {a!r} vs {b!r}" for i, a, b in renamed[:3])
        raise ValueError(
            f"{where} is not the tokenizer saved with the model in {str(model_dir)!r}: {len(renamed)} of its"
            f" {len(tokenizer)} ids name other tokens there (id: data vs model, {shown}), so the model would train"
            f" on text it reads as something else. Use the model's own tokenizer{named}."
        )
