"""ddtree: lossless speculative decoding with DFlash block-diffusion drafters and DDTree draft trees."""
from .api import GenerationResult, Pair, load
from .bench.compare import Comparison, compare
from .base.config import ConfigError, ModelConfig, SamplingParams
from .models.drafter import DFlashDrafter, DrafterConfig

__all__ = ["load", "compare", "Pair", "GenerationResult", "Comparison", "ConfigError", "ModelConfig",
           "SamplingParams", "DFlashDrafter", "DrafterConfig"]
__version__ = "0.1.0"
