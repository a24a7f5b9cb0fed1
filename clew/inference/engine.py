"""clew's rollout engine: batched multi-turn sampling with the KV cache kept across turns.

Why clew carries its own engine rather than vLLM: vLLM is not installable on the machines
clew is built and tested on (it needs a newer torch and an older transformers than they
have), and an engine inside the training process shares the policy's weights, LoRA
adapters included, as the very module objects the optimizer updates, so "weight sync"
after each step costs nothing and can never go stale.

How it works. A ``CacheBatch`` holds a batch of sequences in one transformers cache. Each
turn appends a chunk to every sequence (the previous reply's last token plus the new
observation) and then decodes the reply one token per step, so a turn only prefills the
new tokens, never the history. Sequences are padded to a common cache length, and the
attention mask hides the padding; M-RoPE positions are given explicitly per sequence
(``clew.models.positions``), so padding never shifts a position. Finished sequences
leave the batch, and cache columns that hold only padding are dropped, so the cache stays
close to the real tokens. It is token in, token out: the engine returns sampled ids and
their logprobs, and nothing is re-tokenized from text.

Logprobs are those of the distribution sampled from before top-k/top-p truncation, at the
sampling temperature (at temperature 1 for greedy decoding), which is what the trainer
recomputes for the policy-gradient ratio. The vision placeholder tokens are never
sampled (a reply holding ``<|image_pad|>`` would claim an image that does not exist); the
trainer masks the same ids (``banned_token_ids``) so its logprobs match.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field

import numpy as np
import torch
from transformers import DynamicCache

from clew.errors import ConfigError
from clew.inference.sampling import SamplingParams, filter_logits
from clew.models.chat import ChatFormat, Chunk
from clew.models.logit_masks import AllowedIds, banned_token_ids, keep_allowed, mask_banned
from clew.models.pixels import as_patches, cat_pixels
from clew.models.positions import mrope_positions
from clew.models.precision import bf16_autocast


@dataclass
class Generation:
    """One sampled reply: ids and logprobs per token, and why it ended (stop|length)."""

    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish_reason: str = "length"


def _cache_kwarg(model: torch.nn.Module) -> str:
    # transformers renamed `past_key_values` to `cache` in 5.2x; 5.17 only knows the old name.
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    params = inspect.signature(base.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def kv_bytes_per_token(model: torch.nn.Module) -> int:
    """Bytes of KV cache one token takes across all layers."""
    cfg = model.config
    text = getattr(cfg, "text_config", cfg)
    heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    elem = next(model.parameters()).element_size()
    return 2 * text.num_hidden_layers * heads * head_dim * elem


def cache_budget_bytes(
    device: torch.device, gpu_memory_utilization: float, max_cache_mb: int
) -> int:
    """The KV-cache budget: a share of the GPU's free memory, or a fixed size on CPU."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        in_use_by_us = torch.cuda.memory_reserved(device)
        # vLLM's meaning: the whole process may use this share of the device; the cache
        # gets what the weights and optimizer leave of it.
        return max(0, min(free, int(total * gpu_memory_utilization) - in_use_by_us))
    return max_cache_mb * 2**20


# CacheBatch._compact runs once the visible columns are at most this share of the cache width.
_COMPACT_WHEN_VISIBLE_BELOW = 0.75


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
    ) -> None:
        self.model = model
        # bfloat16 compute over float32 weights (clew.models.precision), as the trainer scores.
        self.autocast = autocast
        self.chat = chat
        self.device = next(model.parameters()).device
        self.bytes_per_token = kv_bytes_per_token(model)
        self.max_cache_bytes = max_cache_bytes
        self.stop_token_ids = stop_token_ids or (chat.im_end_id,)
        self.banned_token_ids = banned_token_ids(chat)
        # The ids of SamplingParams.allowed_tokens; a text that is not one token raises.
        self.allowed_ids = AllowedIds(chat, self.device)
        self._cache_kw = _cache_kwarg(model)

    def open_batch(
        self, size: int, seed: int | None = None, keep_last_k_images: int | None = None
    ) -> CacheBatch:
        return CacheBatch(self, size, seed, keep_last_k_images)

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


class CacheBatch:
    """A batch of sequences sharing one KV cache; rows are addressed by their index at creation."""

    def __init__(
        self,
        engine: InferenceEngine,
        size: int,
        seed: int | None,
        keep_last_k_images: int | None = None,
    ) -> None:
        self.engine = engine
        self.keep_last_k = keep_last_k_images
        # Which image (per sequence, counted from 0) each cache column holds; -1 for text.
        self.image_of_col = torch.zeros(size, 0, dtype=torch.long, device=engine.device)
        self.images_seen = [0] * size
        self.rows: list[int] = list(range(size))  # sequence ids, in cache row order
        self.cache = DynamicCache()
        self.mask = torch.zeros(size, 0, dtype=torch.long, device=engine.device)
        self.next_pos = [0] * size
        self.lengths = [0] * size  # real tokens per sequence (fed + pending)
        self.pending: list[int | None] = [None] * size
        self.generator = torch.Generator(device="cpu")
        self._seed = 0 if seed is None else seed
        self.generator.manual_seed(self._seed)
        self._dev_generator: torch.Generator | None = None

    @property
    def cache_tokens(self) -> int:
        return int(self.mask.shape[1])

    def cache_bytes_after(self, extra_tokens: int) -> int:
        return (self.cache_tokens + extra_tokens) * len(self.rows) * self.engine.bytes_per_token

    def fits(self, extra_tokens: int) -> bool:
        budget = self.engine.max_cache_bytes
        return budget is None or self.cache_bytes_after(extra_tokens) <= budget

    def drop(self, seq_ids: list[int]) -> None:
        """Remove finished sequences from the batch and compact the cache."""
        gone = set(seq_ids)
        keep = [i for i, s in enumerate(self.rows) if s not in gone]
        if len(keep) == len(self.rows):
            return
        self.rows = [self.rows[i] for i in keep]
        idx = torch.tensor(keep, dtype=torch.long, device=self.engine.device)
        self.mask = self.mask.index_select(0, idx)
        self.image_of_col = self.image_of_col.index_select(0, idx)
        for name in ("next_pos", "lengths", "pending", "images_seen"):
            values = getattr(self, name)
            setattr(self, name, [values[i] for i in keep])
        self._select(batch=idx)
        if self.rows:
            cols = self.mask.any(0).nonzero().squeeze(-1)
            if len(cols) < self.mask.shape[1]:
                self.mask = self.mask.index_select(1, cols)
                self.image_of_col = self.image_of_col.index_select(1, cols)
                self._select(cols=cols)

    def _select(self, batch: torch.Tensor | None = None, cols: torch.Tensor | None = None) -> None:
        for layer in getattr(self.cache, "layers", []):
            if getattr(layer, "keys", None) is None or layer.keys.numel() == 0:
                continue
            if batch is not None:
                layer.keys = layer.keys.index_select(0, batch)
                layer.values = layer.values.index_select(0, batch)
            if cols is not None:
                layer.keys = layer.keys.index_select(2, cols)
                layer.values = layer.values.index_select(2, cols)

    @torch.no_grad()
    def extend_and_generate(
        self, chunks: dict[int, Chunk], params: SamplingParams
    ) -> dict[int, Generation]:
        """Append ``chunks[seq]`` to every sequence in the batch and sample one reply each."""
        if set(chunks) != set(self.rows):
            raise ValueError("every sequence in the batch needs a chunk (drop finished ones first)")
        eng, dev = self.engine, self.engine.device
        chat = eng.chat
        token_lists, pos_lists, pix, grids = [], [], [], []
        for r, seq in enumerate(self.rows):
            chunk = chunks[seq]
            ids = ([self.pending[r]] if self.pending[r] is not None else []) + chunk.token_ids
            pos, self.next_pos[r] = mrope_positions(
                ids, chunk.image_grid_thw, self.next_pos[r], chat.image_token_id, chat.merge_size
            )
            token_lists.append(ids)
            pos_lists.append(pos)
            self.lengths[r] += len(chunk.token_ids)
            self.pending[r] = None
            if chunk.pixel_values is not None:
                pix.append(chunk.pixel_values)
                grids.append(chunk.image_grid_thw)
        width = max(len(t) for t in token_lists)
        b = len(self.rows)
        # Left-padded, so every sequence's last real token is the chunk's last column. Built
        # in numpy and handed over once: per-row tensor ops were a visible share of a GPU turn.
        ids_np = np.full((b, width), chat.pad_id, dtype=np.int64)
        pos_np = np.zeros((3, b, width), dtype=np.int64)
        mask_np = np.zeros((b, width), dtype=np.int64)
        for r, (ids, pos) in enumerate(zip(token_lists, pos_lists, strict=True)):
            ids_np[r, width - len(ids) :] = ids
            pos_np[:, r, width - len(ids) :] = pos.numpy()
            mask_np[r, width - len(ids) :] = 1
        # Which image (counted per sequence) each new column holds: runs of image tokens.
        is_image = (ids_np == chat.image_token_id) & (mask_np == 1)
        starts = is_image & ~np.concatenate([np.zeros((b, 1), dtype=bool), is_image[:, :-1]], 1)
        seen = np.asarray(self.images_seen, dtype=np.int64)[:, None]
        image_np = np.where(is_image, seen + np.cumsum(starts, 1) - 1, -1)
        self.images_seen = (seen[:, 0] + starts.sum(1)).tolist()
        input_ids, positions = torch.from_numpy(ids_np), torch.from_numpy(pos_np)
        new_mask, image_ids = torch.from_numpy(mask_np), torch.from_numpy(image_np)
        self._hide_old_images()
        self._compact()
        extra = {}
        if pix:
            extra["pixel_values"] = as_patches(cat_pixels(pix), dev)
            extra["image_grid_thw"] = torch.cat(grids).to(dev)
        logits = self._forward(input_ids, positions, new_mask, image_ids, **extra)
        gens = {seq: Generation() for seq in self.rows}
        active = [True] * b
        for step in range(params.max_tokens):
            tokens, logprobs = self._sample(logits, params)
            for r, seq in enumerate(self.rows):
                if not active[r]:
                    continue
                g = gens[seq]
                g.token_ids.append(tokens[r])
                g.logprobs.append(logprobs[r])
                self.lengths[r] += 1
                self.pending[r] = tokens[r]
                if tokens[r] in eng.stop_token_ids or self._hit_stop_string(g, params):
                    g.finish_reason = "stop"
                    active[r] = False
            if not any(active) or step == params.max_tokens - 1:
                break
            # Feed each active sequence its sampled token; finished ones get masked padding.
            step_ids = [self.pending[r] if active[r] else chat.pad_id for r in range(b)]
            step_pos = [self.next_pos[r] if active[r] else 0 for r in range(b)]
            for r in range(b):
                if active[r]:
                    self.next_pos[r] += 1
                    self.pending[r] = None
            logits = self._forward(
                torch.tensor(step_ids, dtype=torch.long).view(b, 1),
                torch.tensor(step_pos, dtype=torch.long).view(1, b, 1).repeat(3, 1, 1),
                torch.tensor(active, dtype=torch.long).view(b, 1),
            )
        return gens

    def _hide_old_images(self) -> None:
        """Mask the cache columns of images older than the last ``keep_last_k`` of each row."""
        if not self.keep_last_k or self.image_of_col.numel() == 0:
            return
        limit = torch.tensor(self.images_seen, device=self.mask.device)[:, None] - self.keep_last_k
        hidden = (self.image_of_col >= 0) & (self.image_of_col < limit)
        self.mask = self.mask.masked_fill(hidden, 0)

    def _compact(self) -> None:
        """Drop the cache columns a row can no longer see (hidden images, padding), row by row.

        A hidden column is never shown again and a masked column adds exactly nothing to
        attention, so removing it changes no logit (up to float summation order); the cached
        keys already carry their rotary positions, so moving a column changes nothing either.
        With ``keep_last_k_images`` most of a long episode's cache is old images: without
        this, every decode step would still read, concatenate and expand them.
        """
        b, n = self.mask.shape
        if n == 0:
            return
        visible = self.mask.bool()
        width = int(visible.sum(1).max())
        # A copy of the whole cache per compaction: only worth it once a quarter is dead.
        if width > _COMPACT_WHEN_VISIBLE_BELOW * n:
            return
        # Visible columns keep their order and are right-aligned; a row with fewer than
        # ``width`` is left-padded with some of its masked columns.
        order = torch.argsort(visible.to(torch.int8), dim=1, stable=True)
        idx = order[:, n - width :]
        self.mask = self.mask.gather(1, idx)
        self.image_of_col = self.image_of_col.gather(1, idx)
        for layer in getattr(self.cache, "layers", []):
            if getattr(layer, "keys", None) is None or layer.keys.numel() == 0:
                continue
            for name in ("keys", "values"):
                t = getattr(layer, name)
                index = idx[:, None, :, None].expand(b, t.shape[1], width, t.shape[3])
                setattr(layer, name, t.gather(2, index))

    def _hit_stop_string(self, g: Generation, params: SamplingParams) -> bool:
        if not params.stop:
            return False
        tail = self.engine.chat.decode(g.token_ids[-32:])
        return any(s in tail for s in params.stop)

    def _forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        new_mask: torch.Tensor,
        image_ids: torch.Tensor | None = None,
        **extra,
    ) -> torch.Tensor:
        dev = self.engine.device
        self.mask = torch.cat([self.mask, new_mask.to(dev)], dim=1)
        if image_ids is None:
            image_ids = torch.full(input_ids.shape, -1, dtype=torch.long)
        self.image_of_col = torch.cat([self.image_of_col, image_ids.to(dev)], dim=1)
        with bf16_autocast(dev, self.engine.autocast):
            out = self.engine.model(
                input_ids=input_ids.to(dev),
                attention_mask=self.mask,
                position_ids=positions.to(dev),
                use_cache=True,
                logits_to_keep=1,
                **{self.engine._cache_kw: self.cache},
                **extra,
            )
        return mask_banned(out.logits[:, -1, :].float(), self.engine.banned_token_ids)

    def _sample(
        self, logits: torch.Tensor, params: SamplingParams
    ) -> tuple[list[int], list[float]]:
        """One token per row and its logprob, as Python lists (one device-to-host copy)."""
        temperature = 1.0 if params.greedy else params.temperature
        if params.allowed_tokens:
            logits = keep_allowed(logits, self.engine.allowed_ids(params.allowed_tokens))
        logp = torch.log_softmax(logits / temperature, dim=-1)
        if params.greedy:
            tokens = logits.argmax(-1)
        else:
            probs = filter_logits(logits / temperature, params.top_k, params.top_p).softmax(-1)
            if probs.device.type == "cpu":
                tokens = torch.multinomial(probs, 1, generator=self.generator).squeeze(-1)
            else:
                # On an accelerator the draw stays there: copying [rows, vocab] probabilities
                # to the host and drawing there was 1.5 s of a 10.5 s batch (profile_rollout).
                tokens = torch.multinomial(probs, 1, generator=self._device_generator()).squeeze(-1)
        picked = logp.gather(-1, tokens.view(-1, 1)).squeeze(-1)
        both = torch.stack([tokens.double(), picked.double()]).cpu()
        return [int(t) for t in both[0].tolist()], both[1].tolist()

    def _device_generator(self) -> torch.Generator:
        if self._dev_generator is None:
            self._dev_generator = torch.Generator(device=self.engine.device)
            self._dev_generator.manual_seed(self._seed)
        return self._dev_generator
