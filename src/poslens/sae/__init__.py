"""TopK sparse autoencoders on ViT activations: config, model, activation store, training,
quality metrics, splicing into the model and SAELens-style save/load."""

from poslens.sae.config import SAEConfig
from poslens.sae.metrics import evaluate, fvu, splice, spliced_quality
from poslens.sae.model import TopKSAE, Whitening
from poslens.sae.store import ActivationStore
from poslens.sae.train import train_sae

__all__ = [
    "ActivationStore",
    "SAEConfig",
    "TopKSAE",
    "Whitening",
    "evaluate",
    "fvu",
    "splice",
    "spliced_quality",
    "train_sae",
]
