"""Lightning: the training module, the DataModules and the callbacks."""

from .datamodule import StdlibDataModule, TokenWindows
from .module import GLM46LitModule

__all__ = ["GLM46LitModule", "StdlibDataModule", "TokenWindows"]
