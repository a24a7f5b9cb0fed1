"""The sizes of the model presets ``clew init-model --preset`` builds (``clew.models.factory``).

Parameters with the default tokenizer (404 entries: ``build_tokenizer()``; each extra entry
adds ``2 * hidden``, input and output embeddings), derived from the config alone by
``clew.models.sizes`` (``factory.preset_parameters``; a test holds this table to it).
Qwen3-VL with its own geometry (patch 16, Qwen3-VL's 2304-entry position table)::

    preset      text: hidden x layers (heads/kv, mlp)  vision: width x depth (heads)      Qwen2-VL       Qwen3-VL
    tiny        128 x 3 (4/2, 512)                     128 x 1 (4)                       1,519,744      2,189,632
    small       256 x 6 (4/2, 1024)                    128 x 4 (4)                       7,449,344      8,578,176
    deep        256 x 12 (4/2, 1024)                   128 x 8 (4)                      14,146,816     15,668,352
    medium      384 x 8 (6/2, 1536)                    128 x 4 (4)                      19,026,944     20,285,312
    base        768 x 12 (12/4, 3072)                  512 x 12 (8)                    148,665,856    167,338,752
    qwen3vl-8b  4096 x 36 (32/8, 12288)                1152 x 27 (16)                            -  7,525,773,552

``tiny`` trains on a CPU (tests, the CPU main job); ``small`` learns mazes from pixels on
one GPU (docs/learning-easy.md); ``deep`` is ``small`` with twice the layers, for a policy
that must plan further in one forward pass (the ``easy`` maze's first moves); ``medium`` is
the one-GPU ``maze_2d/easy`` recipe's; ``base`` is for GPU benchmarks.

``qwen3vl-8b`` is Qwen3-VL-8B-Instruct's architecture (Qwen3-VL only; the sizes and where
each comes from are beside its entry), for speed work at the users' scale. With Qwen's
151,936-entry vocabulary (``padded_vocab_size``, ``clew init-model --vocab-size 151936``) it
has 8,767,123,696 parameters, the real model's 8.77B, of which 576,388,336 in the vision
tower: 17.5 GB in bfloat16. Build it on a GPU (``--device cuda``: bfloat16, made on the
device itself, ``clew.models.on_device``).

``arch="qwen3_vl"`` builds ``Qwen3VLForConditionalGeneration`` from the same presets
(``clew.models.qwen3`` says what differs: a learned, interpolated absolute position
embedding in the vision tower, deepstack taps, Qwen3 attention, interleaved M-RoPE,
patch 16 by default). Its vision tower is larger: one more merger per deepstack tap
(``Preset.vision_deepstack``) and the position table, ``(image_size / patch_size) ** 2``
entries with ``image_size``: at ``image_size=256`` (256 entries) tiny has 1,927,488
parameters (1.09M vision), small 8,316,032, deep 15,406,208, medium 20,023,168 and base
166,290,176 (61.8M vision).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = ["PRESETS", "QWEN_VOCAB_SIZE", "Preset"]


@dataclass(frozen=True)
class Preset:
    """The sizes of one model preset; ``approx_parameters`` is its rounded count in the table
    above (default architecture and tokenizer)."""

    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    vision_embed_dim: int
    vision_depth: int
    vision_num_heads: int
    vision_mlp_ratio: int
    approx_parameters: str
    # Qwen3-VL only: vision layers whose features are added after language layers 0, 1, ...
    vision_deepstack: tuple[int, ...] = ()
    # The one architecture a preset copied from a real checkpoint is (None: either).
    arch: str | None = None
    # Config fields the sizes above do not set, as a real checkpoint has them; the caller's
    # text / vision overrides still replace them.
    text_fields: Mapping[str, Any] = field(default_factory=dict)
    vision_fields: Mapping[str, Any] = field(default_factory=dict)


PRESETS: dict[str, Preset] = {
    "tiny": Preset(128, 3, 4, 2, 512, 128, 1, 4, 4, "1.52M", vision_deepstack=(0,)),
    "small": Preset(256, 6, 4, 2, 1024, 128, 4, 4, 4, "7.45M", vision_deepstack=(1, 3)),
    "deep": Preset(256, 12, 4, 2, 1024, 128, 8, 4, 4, "14.1M", vision_deepstack=(1, 3, 5)),
    "medium": Preset(384, 8, 6, 2, 1536, 128, 4, 4, 4, "19.0M", vision_deepstack=(1, 3)),
    "base": Preset(768, 12, 12, 4, 3072, 512, 12, 8, 4, "149M", vision_deepstack=(3, 7, 11)),
    # Qwen3-VL-8B-Instruct's architecture. Every size is its published config.json's
    # (huggingface.co/Qwen/Qwen3-VL-8B-Instruct/blob/main/config.json) as transformers'
    # Qwen3VLConfig reads it. text_config: hidden_size 4096, num_hidden_layers 36,
    # num_attention_heads 32, num_key_value_heads 8, head_dim 128 (= 4096 / 32),
    # intermediate_size 12288, rms_norm_eps 1e-6, max_position_embeddings 262144, no
    # attention bias, untied embeddings, rope_theta 5e6 and interleaved mrope_section
    # [24, 20, 20] (clew.models.qwen3's defaults for head_dim 128). vision_config: depth 27,
    # hidden_size 1152, intermediate_size 4304, num_heads 16, patch_size 16, merge 2,
    # temporal patch 2, num_position_embeddings 2304, deepstack_visual_indexes [8, 16, 24],
    # gelu_pytorch_tanh (transformers' Qwen3VLVisionConfig defaults are this tower), and
    # out_hidden_size 4096 (the text width). Its vocabulary is 151,936 entries
    # (build_model's padded_vocab_size), clew's task tokenizer otherwise.
    "qwen3vl-8b": Preset(
        4096,
        36,
        32,
        8,
        12288,
        1152,
        27,
        16,
        4,  # unused: intermediate_size 4304 below is not a multiple of the width
        "7.53B",  # 8.77B with Qwen's vocabulary
        vision_deepstack=(8, 16, 24),
        arch="qwen3_vl",
        text_fields={"head_dim": 128, "max_position_embeddings": 262144, "rms_norm_eps": 1e-6},
        vision_fields={"intermediate_size": 4304, "num_position_embeddings": 2304},
    ),
}
# The vocabulary of a real Qwen checkpoint (Qwen2-VL, Qwen2.5-VL and Qwen3-VL alike).
QWEN_VOCAB_SIZE = 151_936
