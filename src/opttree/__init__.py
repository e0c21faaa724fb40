"""opttree: lossless speculative decoding over adaptive draft trees (OPT-Tree) for Hugging Face causal LMs."""

from .config import SpecConfig
from .demo import demo_models
from .engine import Generation, GenerationOutput, generate, stream
from .policies import available as available_policies
from .policies import register_policy
from .stats import GenerationStats
from .text import TextStream
from .tree import DraftTree

__all__ = [
    "SpecConfig",
    "demo_models",
    "Generation",
    "GenerationOutput",
    "GenerationStats",
    "DraftTree",
    "TextStream",
    "generate",
    "stream",
    "register_policy",
    "available_policies",
]
__version__ = "0.1.0"
