"""fastremover: fast, verifiable video object removal (MiniMax-Remover) on NVIDIA GPUs."""

from fastremover.errors import FastRemoverError

__version__ = "0.1.0"

__all__ = ["FastRemoverError", "__version__"]
