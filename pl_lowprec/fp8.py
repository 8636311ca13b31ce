"""``pl_lowprec.fp8.FP8Config``, the class path configs have used: the config lives in ``pl_lowprec.transforms.fp8``."""

from pl_lowprec.transforms.fp8 import FP8Config, FP8Recipe

__all__ = ["FP8Config", "FP8Recipe"]
