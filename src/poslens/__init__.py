"""poslens: how a Vision Transformer represents where each patch is, under APE and RoPE."""

__version__ = "0.1.0"

from poslens.api import load, load_images, load_task
from poslens.errors import UserError
from poslens.models import ModelConfig, ViT, build_model

__all__ = [
    "ModelConfig",
    "UserError",
    "ViT",
    "__version__",
    "build_model",
    "load",
    "load_images",
    "load_task",
]
