"""clew's rollout engine: batched multi-turn sampling with the KV cache kept across turns.

Why clew carries its own engine rather than vLLM: vLLM cannot share an environment with
clew (it needs a newer torch and an older transformers than clew supports), and an engine
inside the training process shares the policy's weights, LoRA adapters included, as the
very module objects the optimizer updates, so "weight sync" after each step costs nothing
and can never go stale.

How it works. A ``CacheBatch`` (``clew.inference.cache_batch``) holds a batch of sequences in one
KV cache. Each turn
appends a chunk to every sequence (the previous reply's last token plus the new
observation) and then decodes the reply one token per step, so a turn only prefills the
new tokens, never the history. A turn's chunks are left-padded to one width, so every
row's last real token is the last column and one logit row per sequence comes out (on a GPU,
where the attention reads rows by their lengths, the real tokens run packed instead:
``clew.inference.cache_batch``); M-RoPE
positions are given explicitly per sequence (``clew.models.positions``), so padding never
shifts a position. Finished sequences leave the batch. It is token in, token out: the
engine returns sampled ids and their logprobs, and nothing is re-tokenized from text.
A reply ends on any of ``stop_token_ids``: ``<|im_end|>``, the tokenizer's eos and the
eos ids of the model's ``generation_config`` (its generation_config.json), unless the
caller names its own; the stop id is the reply's last token, and ``ChatFormat.decode``
leaves it out of the text.

One cache, ``SlotCache`` (``clew.inference.kv_cache``): every row's keys are written in
place into preallocated per-layer slots and each row attends over its own live columns
(``clew.inference.attention``). A decode step builds its inputs, mask and positions on the
device; the one host copy per step is the sampled tokens and logprobs. On a GPU decode steps
are replayed from CUDA graphs (``cuda_graphs``; ``clew.inference.cuda_graphs``).

Logprobs are those of the distribution sampled from before top-k/top-p truncation, at the
sampling temperature (at temperature 1 for greedy decoding), which is what the trainer
recomputes for the policy-gradient ratio. The vision placeholder tokens are never
sampled (a reply holding ``<|image_pad|>`` would claim an image that does not exist); the
trainer masks the same ids (``banned_token_ids``) so its logprobs match.

Rows may run different LoRA adapters in one batch (``add_adapter``, ``open_batch(adapters=)``;
``clew.inference.multi_lora``); a row keeps its adapter when others leave the batch. Rows
can join a running batch between turns (``CacheBatch.add_rows``): continuous batching, for
``clew serve``.
"""

from __future__ import annotations

import importlib.util
import inspect
from dataclasses import dataclass

import torch

from clew.errors import ConfigError
from clew.inference.cache_batch import CacheBatch
from clew.inference.kv_cache import cache_budget_bytes, kv_bytes_per_token
from clew.inference.kv_store import KVStore
from clew.inference.multi_lora import AdapterSource, MultiLoRA
from clew.inference.prefill_graphs import PrefillGraphs
from clew.inference.vision_graphs import VisionGraphs
from clew.kernels.fused_pointwise import fuse_pointwise
from clew.models.chat import ChatFormat
from clew.models.logit_masks import AllowedIds, banned_token_ids

DECODE_ATTENTION = ("auto", "sdpa", "varlen", "triton")
PREFILL_ATTENTION = ("auto", "sdpa", "varlen", "triton")


def _cache_kwarg(model: torch.nn.Module) -> str:
    # transformers renamed `past_key_values` to `cache` in 5.2x; 5.17 only knows the old name.
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    params = inspect.signature(base.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def _text_config(model: torch.nn.Module):
    cfg = model.config
    return getattr(cfg, "text_config", cfg)


def generation_eos_ids(model: torch.nn.Module) -> int | list[int] | None:
    """The eos id(s) of ``model``'s ``generation_config`` (an int or a list, as its
    generation_config.json gives them; ``from_pretrained`` loads that file), None if none."""
    config = getattr(model, "generation_config", None)
    return getattr(config, "eos_token_id", None)


def _resolve_attention(key: str, name: str, device: torch.device) -> str:
    """``key``'s value ``name`` as the engine runs it on ``device``: ``auto`` is ``triton``
    on CUDA where the triton package is installed, else ``varlen``; ``triton`` without the
    package is refused."""
    has_triton = importlib.util.find_spec("triton") is not None
    if name == "auto":
        return "triton" if device.type == "cuda" and has_triton else "varlen"
    if name == "triton" and not has_triton:
        raise ConfigError(
            f"generator.inference_engine.{key}=triton runs clew's Triton kernel, "
            "and the triton package is not installed (torch's CUDA builds bring it; on a "
            "CPU `pip install triton` runs it in Triton's interpreter): install it or "
            f"choose {key}=varlen"
        )
    return name


def resolve_decode_attention(name: str, device: torch.device) -> str:
    """``decode_attention`` as the engine runs it on ``device`` (``_resolve_attention``)."""
    return _resolve_attention("decode_attention", name, device)


def resolve_prefill_attention(name: str, device: torch.device) -> str:
    """``prefill_attention`` as the engine runs it on ``device`` (``_resolve_attention``)."""
    return _resolve_attention("prefill_attention", name, device)


class InferenceEngine:
    """Samples replies for many sequences at once from a (possibly LoRA-wrapped) Qwen-VL model."""

    def __init__(
        self,
        model: torch.nn.Module,
        chat: ChatFormat,
        *,
        max_cache_bytes: int | None = None,
        stop_token_ids: tuple[int, ...] | None = None,
        autocast: bool = False,
        cuda_graphs: bool = False,
        decode_attention: str = "auto",
        prefill_attention: str = "auto",
        fused_pointwise: bool | None = None,
        prefill_graphs: bool = False,
        vision_graphs: bool = False,
    ) -> None:
        self.model = model
        # Decode steps replayed from CUDA graphs (rows without adapters); on a CPU the same
        # fixed-shape steps run eagerly (clew.inference.cuda_graphs).
        self.cuda_graphs = cuda_graphs
        if decode_attention not in DECODE_ATTENTION:
            raise ConfigError(
                f"generator.inference_engine.decode_attention={decode_attention!r} is not a "
                f"decode attention; choose one of {', '.join(DECODE_ATTENTION)}"
            )
        device = next(model.parameters()).device
        decode_attention = resolve_decode_attention(decode_attention, device)
        # In graph-replayed decode steps: SDPA to the longest row, or a variable-length
        # kernel (memory-efficient, or clew's split-KV Triton kernel) per row's columns;
        # "auto": the Triton kernel on CUDA, if installed.
        self.decode_attention = decode_attention
        if prefill_attention not in PREFILL_ATTENTION:
            raise ConfigError(
                f"generator.inference_engine.prefill_attention={prefill_attention!r} is not a "
                f"prefill attention; choose one of {', '.join(PREFILL_ATTENTION)}"
            )
        # A turn's prefill: SDPA under the mask to the longest row, or each row reading its
        # own columns (FlashAttention's kernel or clew's Triton kernel,
        # clew.inference.attention); "auto": the Triton kernel on CUDA, if installed.
        self.prefill_attention = resolve_prefill_attention(prefill_attention, device)
        # A prefill's real tokens alone, row after row (clew.inference.cache_batch), where the
        # attention reads rows by their lengths: on CUDA only. On a CPU the packed attention
        # is the masked reference, and a tiny-model rollout was measured slower packed
        # (benchmarks/rollout.py). Not a key: tests set it to compare the two layouts.
        on_cuda = device.type == "cuda"
        self.pack_prefill = on_cuda
        # The rotary embedding and the SwiGLU gate as one compiled kernel each, in the
        # engine's forwards on CUDA (clew.kernels.fused_pointwise); None: on a CUDA device.
        self.fused_pointwise = on_cuda if fused_pointwise is None else fused_pointwise
        if self.fused_pointwise:
            fuse_pointwise(model)
        # bfloat16 compute over float32 weights (clew.models.precision), as the trainer scores.
        self.autocast = autocast
        self.chat = chat
        self.device = device
        self.bytes_per_token = kv_bytes_per_token(model)
        self.num_layers = _text_config(model).num_hidden_layers
        self.max_cache_bytes = max_cache_bytes
        # A reply ends on <|im_end|>, the tokenizer's eos or any of the model's
        # generation_config eos ids (as transformers' generate and vLLM stop); the chat
        # format learns them too, so its decode leaves a closing one out of the text.
        if not stop_token_ids:
            chat.add_stop_ids(generation_eos_ids(model))
            stop_token_ids = chat.stop_token_ids
        self.stop_token_ids = tuple(stop_token_ids)
        # On the device once: a per-step upload would be a host transfer every decode step.
        self.banned_token_ids = banned_token_ids(chat).to(self.device)
        self._stop_ids = torch.tensor(self.stop_token_ids, dtype=torch.long, device=self.device)
        # The ids of SamplingParams.allowed_tokens; a text that is not one token raises.
        self.allowed_ids = AllowedIds(chat, self.device)
        self._cache_kw = _cache_kwarg(model)
        # A padded prefill's layers replayed from CUDA graphs (eagerly, bucketed, on a CPU),
        # over KV buffers kept between batches (clew.inference.prefill_graphs, kv_store).
        self.prefill_graphs: PrefillGraphs | None = None
        self.kv_store: KVStore | None = None
        if prefill_graphs:
            self.prefill_graphs = PrefillGraphs(capture=on_cuda)
            self.kv_store = KVStore()
        # The vision tower replayed from CUDA graphs by bucket of distinct frames (eagerly,
        # bucketed, on a CPU): clew.inference.vision_graphs.
        self.vision_graphs = VisionGraphs(capture=on_cuda) if vision_graphs else None
        # Adapters rows can name (clew.inference.multi_lora); layers are wrapped on first add.
        self.lora = MultiLoRA(model)

    def add_adapter(self, name: str, source: AdapterSource) -> None:
        """Load a PEFT LoRA adapter (its folder, or ``(config, tensors)``) for rows to name."""
        self.lora.add(name, source)

    def remove_adapter(self, name: str) -> None:
        self.lora.remove(name)

    def open_batch(
        self,
        size: int,
        seed: int | None = None,
        keep_last_k_images: int | None = None,
        capacity_hint: int | None = None,
        adapters: list[str | None] | None = None,
    ) -> CacheBatch:
        """A batch of ``size`` sequences; ``capacity_hint``: the longest a row is expected to
        grow, in tokens, which the cache allocates at once when a budget is set;
        ``adapters``: each row's adapter (``add_adapter``), None for the bare base."""
        batch = CacheBatch(self, size, seed, keep_last_k_images, capacity_hint)
        batch.adapters = self.lora.check_rows(adapters, size)
        return batch

    def max_sequences(self, tokens_per_sequence: int) -> int:
        """How many sequences of this length fit the cache budget (at least 1 if any fits)."""
        if self.max_cache_bytes is None:
            return 1 << 30
        n = self.max_cache_bytes // max(1, tokens_per_sequence * self.bytes_per_token)
        if n < 1:
            raise ConfigError(
                f"the KV-cache budget ({self.max_cache_bytes / 2**20:.1f} MiB) cannot hold one "
                f"sequence of {tokens_per_sequence} tokens "
                f"({tokens_per_sequence * self.bytes_per_token / 2**20:.1f} MiB); raise "
                "generator.inference_engine.gpu_memory_utilization / max_cache_mb or lower "
                "generator.max_input_length"
            )
        return int(n)


@dataclass(frozen=True)
class EngineOptions:
    """How a policy worker's engine runs (``generator.inference_engine``'s keys, documented
    there): what a worker group hands each worker, which builds its engine on its device."""

    cuda_graphs: bool = True  # on a CUDA device only
    decode_attention: str = "auto"
    prefill_attention: str = "auto"
    fused_pointwise: bool = True
    prefill_cuda_graphs: bool = False  # on a CUDA device only
    vision_cuda_graphs: bool = False  # on a CUDA device only
    gpu_memory_utilization: float = 0.45  # of a GPU, for the KV cache budget
    max_cache_mb: int = 4096  # the budget on a CPU

    def budget(self, device: torch.device) -> int:
        """The KV cache budget in bytes, from the device's free memory now."""
        return cache_budget_bytes(device, self.gpu_memory_utilization, self.max_cache_mb)

    def build(
        self,
        model: torch.nn.Module,
        chat: ChatFormat,
        *,
        autocast: bool = False,
        max_cache_bytes: int | None = None,
    ) -> InferenceEngine:
        """The engine over ``model`` (its cache budget measured now unless given)."""
        device = next(model.parameters()).device
        return InferenceEngine(
            model,
            chat,
            max_cache_bytes=self.budget(device) if max_cache_bytes is None else max_cache_bytes,
            autocast=autocast,
            cuda_graphs=self.cuda_graphs and device.type == "cuda",
            decode_attention=self.decode_attention,
            prefill_attention=self.prefill_attention,
            fused_pointwise=self.fused_pointwise,
            prefill_graphs=self.prefill_cuda_graphs and device.type == "cuda",
            vision_graphs=self.vision_cuda_graphs and device.type == "cuda",
        )
