"""``pl_lowprec.qat.QATConfig``, the class path configs have used: the config lives in ``pl_lowprec.transforms.qat``."""

from pl_lowprec.transforms.qat import QATConfig, QATScheme

__all__ = ["QATConfig", "QATScheme"]
