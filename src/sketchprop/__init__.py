"""sketchprop: memory-efficient backpropagation through linear layers with sketched weight gradients.

>>> from sketchprop import patch_activations, patch_linear
>>> names = patch_linear(model, sketch="gaussian", rho=0.1, exclude=r"classifier")
>>> names += patch_activations(model)   # seeded dropout, recomputed attention, few-bit GELU
"""

from .activations import chunked_lm_loss
from .layers import RandomizedLinear
from .patching import (
    find_linear,
    patch_activations,
    patch_linear,
    unpatch_activations,
    unpatch_linear,
)
from .sketches import SKETCHES, Sketch, get_sketch

__all__ = [
    "RandomizedLinear",
    "SKETCHES",
    "Sketch",
    "chunked_lm_loss",
    "find_linear",
    "get_sketch",
    "patch_activations",
    "patch_linear",
    "unpatch_activations",
    "unpatch_linear",
]
__version__ = "0.1.0"
