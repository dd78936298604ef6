"""poslens: how a Vision Transformer represents where each patch is, under APE and RoPE."""

from poslens._version import __version__
from poslens.allocator import keep_freed_memory, release_freed_memory
from poslens.api import load, load_images, load_task, save
from poslens.errors import UserError
from poslens.models import ModelConfig, ViT, build_model

__all__ = [
    "ModelConfig",
    "UserError",
    "ViT",
    "__version__",
    "build_model",
    "keep_freed_memory",
    "load",
    "load_images",
    "load_task",
    "release_freed_memory",
    "save",
]
