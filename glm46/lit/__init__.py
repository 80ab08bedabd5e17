"""Lightning: the training module, the DataModules, the callbacks and the strategies of the parallel layouts."""

from .datamodule import StdlibDataModule, TokenWindows
from .module import GLM46LitModule
from .strategies import DeepSpeedStrategy, MeshParallelStrategy, build_strategy

__all__ = [
    "DeepSpeedStrategy",
    "GLM46LitModule",
    "MeshParallelStrategy",
    "StdlibDataModule",
    "TokenWindows",
    "build_strategy",
]
