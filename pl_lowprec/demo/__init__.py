"""The embedded default task: text that ships with Python, tiny models built from configs, no downloads."""

from pl_lowprec.demo.stdlib_text import StdlibTextDataModule
from pl_lowprec.demo.tiny_gpt import TinyGPT
from pl_lowprec.demo.tiny_llama import TinyLlama

__all__ = ["StdlibTextDataModule", "TinyGPT", "TinyLlama"]
