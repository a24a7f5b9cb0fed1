"""Qwen-VL policies: build small ones offline, load any local checkpoint.

``build_model`` makes a random-weight Qwen2-VL or Qwen3-VL policy with a task-sized tokenizer and saves
it as a standard Hugging Face directory; ``load_policy`` loads that or any Qwen2-VL,
Qwen2.5-VL or Qwen3-VL directory as ``(model, processor)``. Importing this package also
lets ``transformers.AutoProcessor`` read the directories ``build_model`` writes.
"""

from clew.models.factory import ARCHS, PRESETS, BuiltModel, Preset, build_model, count_parameters
from clew.models.loading import SUPPORTED_MODEL_TYPES, load_policy, load_processor
from clew.models.processor import ClewVLProcessor
from clew.models.tokenizer import build_tokenizer, default_corpus

__all__ = [
    "ARCHS",
    "PRESETS",
    "SUPPORTED_MODEL_TYPES",
    "BuiltModel",
    "ClewVLProcessor",
    "Preset",
    "build_model",
    "build_tokenizer",
    "count_parameters",
    "default_corpus",
    "load_policy",
    "load_processor",
]
