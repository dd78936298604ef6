"""The instrumented ViT, its positional encodings and hook points."""

from poslens.models.config import POSENCS, ModelConfig
from poslens.models.hooks import HookedModule, HookPoint
from poslens.models.vit import ViT, build_model

__all__ = ["POSENCS", "HookPoint", "HookedModule", "ModelConfig", "ViT", "build_model"]
