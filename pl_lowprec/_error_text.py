"""Another library's error inside one of ours: its type and first words, cut where a word ends."""

from __future__ import annotations

import os
import textwrap


def briefly(err: BaseException, width: int = 200) -> str:
    """``"ConnectError: [Errno -2] Name or service ..."``: the message on one line, at most ``width`` characters,
    cut at a word (a network error's message runs to pages; cut mid-word it reads as a typo)."""
    return f"{type(err).__name__}: {textwrap.shorten(str(err), width, placeholder=' ...')}"


def raised_in(err: BaseException) -> str | None:
    """The file of the innermost frame of ``err``'s traceback: where it was raised."""
    tb = err.__traceback__
    last = None
    while tb is not None:
        last = tb.tb_frame.f_code.co_filename
        tb = tb.tb_next
    return last


def raised_under(err: BaseException, *folders: str) -> bool:
    """Whether ``err`` was raised in a file under ``folders`` (``"pl_lowprec", "transforms"``)."""
    where = raised_in(err)
    return where is not None and f"{os.sep}{os.sep.join(folders)}{os.sep}" in where
