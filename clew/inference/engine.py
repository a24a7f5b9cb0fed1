"""clew's rollout engine: batched multi-turn sampling with the KV cache kept across turns.

Why clew carries its own engine rather than vLLM: vLLM is not installable on the machines
clew is built and tested on (it needs a newer torch and an older transformers than they
have), and an engine inside the training process shares the policy's weights, LoRA
adapters included, as the very module objects the optimizer updates, so "weight sync"
after each step costs nothing and can never go stale.

How it works. A ``CacheBatch`` holds a batch of sequences in one KV cache. Each turn
appends a chunk to every sequence (the previous reply's last token plus the new
observation) and then decodes the reply one token per step, so a turn only prefills the
new tokens, never the history. A turn's chunks are left-padded to one width, so every
row's last real token is the last column and one logit row per sequence comes out; M-RoPE
positions are given explicitly per sequence (``clew.models.positions``), so padding never
shifts a position. Finished sequences leave the batch. It is token in, token out: the
engine returns sampled ids and their logprobs, and nothing is re-tokenized from text.

Two caches (``generator.inference_engine.kv_cache``, ``clew.inference.kv_cache``):
``static`` (the default) writes every row's keys in place into preallocated per-layer slots
and attends over each row's live columns with grouped-query SDPA
(``clew.inference.attention``); ``dynamic`` is transformers' ``DynamicCache``, which
concatenates onto the whole cache every forward, kept as the reference path. Both give the
same tokens and logprobs (to float summation order). A decode step builds its inputs, mask
and positions on the device; the one host copy per step is the sampled tokens and logprobs.

Logprobs are those of the distribution sampled from before top-k/top-p truncation, at the
sampling temperature (at temperature 1 for greedy decoding), which is what the trainer
recomputes for the policy-gradient ratio. The vision placeholder tokens are never
sampled (a reply holding ``<|image_pad|>`` would claim an image that does not exist); the
trainer masks the same ids (``banned_token_ids``) so its logprobs match.

Rows may run different LoRA adapters in one batch (``add_adapter``, ``open_batch(adapters=)``;
``clew.inference.multi_lora``); a row keeps its adapter when others leave the batch.
"""

from __future__ import annotations

import contextlib
import inspect
from dataclasses import dataclass, field

import numpy as np
import torch

from clew.errors import ConfigError
from clew.inference.attention import engine_attention
from clew.inference.kv_cache import DynamicKV, SlotCache, kv_bytes_per_token
from clew.inference.kv_cache import cache_budget_bytes as cache_budget_bytes  # its old home
from clew.inference.multi_lora import AdapterSource, MultiLoRA
from clew.inference.sampling import SamplingParams, filter_logits
from clew.models.chat import ChatFormat, Chunk
from clew.models.logit_masks import AllowedIds, banned_token_ids, keep_allowed, mask_banned
from clew.models.pixels import as_patches, cat_pixels
from clew.models.positions import mrope_positions
from clew.models.precision import bf16_autocast

KV_CACHES = ("static", "dynamic")


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


def _text_config(model: torch.nn.Module):
    cfg = model.config
    return getattr(cfg, "text_config", cfg)


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
        kv_cache: str = "static",
    ) -> None:
        if kv_cache not in KV_CACHES:
            raise ConfigError(
                f"generator.inference_engine.kv_cache={kv_cache!r} is not a KV cache; "
                f"choose one of {', '.join(KV_CACHES)}"
            )
        self.model = model
        self.kv_cache = kv_cache
        # bfloat16 compute over float32 weights (clew.models.precision), as the trainer scores.
        self.autocast = autocast
        self.chat = chat
        self.device = next(model.parameters()).device
        self.bytes_per_token = kv_bytes_per_token(model)
        self.num_layers = _text_config(model).num_hidden_layers
        self.max_cache_bytes = max_cache_bytes
        self.stop_token_ids = stop_token_ids or (chat.im_end_id,)
        # On the device once: a per-step upload would be a host transfer every decode step.
        self.banned_token_ids = banned_token_ids(chat).to(self.device)
        self._stop_ids = torch.tensor(self.stop_token_ids, dtype=torch.long, device=self.device)
        # The ids of SamplingParams.allowed_tokens; a text that is not one token raises.
        self.allowed_ids = AllowedIds(chat, self.device)
        self._cache_kw = _cache_kwarg(model)
        # Adapters rows can name (clew.inference.multi_lora); layers are wrapped on first add.
        self.lora = MultiLoRA(model)

    def add_adapter(self, name: str, source: AdapterSource) -> None:
        """Load a PEFT LoRA adapter (its folder, or ``(config, tensors)``) for rows to name."""
        self.lora.add(name, source)

    def remove_adapter(self, name: str) -> None:
        self.lora.remove(name)

    @property
    def counts_real_lengths(self) -> bool:
        """Whether a batch's budget counts its rows' real lengths (the static cache) rather
        than one padded width for all (the dynamic cache)."""
        return self.kv_cache == "static"

    def open_batch(
        self,
        size: int,
        seed: int | None = None,
        keep_last_k_images: int | None = None,
        capacity_hint: int | None = None,
        adapters: list[str | None] | None = None,
    ) -> CacheBatch:
        """A batch of ``size`` sequences; ``capacity_hint``: the longest a row is expected to
        grow, in tokens, which the static cache allocates at once when a budget is set;
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


class CacheBatch:
    """A batch of sequences sharing one KV cache; rows are addressed by their index at creation."""

    def __init__(
        self,
        engine: InferenceEngine,
        size: int,
        seed: int | None,
        keep_last_k_images: int | None = None,
        capacity_hint: int | None = None,
    ) -> None:
        self.engine = engine
        self.keep_last_k = keep_last_k_images
        dev = engine.device
        budget = {"bytes_per_token": engine.bytes_per_token, "budget_bytes": engine.max_cache_bytes}
        self.kv: SlotCache | DynamicKV
        if engine.kv_cache == "static":
            self.kv = SlotCache(engine.num_layers, size, dev, capacity_hint=capacity_hint, **budget)
        else:
            self.kv = DynamicKV(size, dev, **budget)
        self.images_seen = [0] * size
        self.rows: list[int] = list(range(size))  # sequence ids, in cache row order
        self.next_pos = [0] * size
        self.lengths = [0] * size  # real tokens per sequence (fed + pending)
        self.pending: list[int | None] = [None] * size
        self.adapters: list[str | None] = [None] * size  # each row's adapter, None: the base
        self.generator = torch.Generator(device="cpu")
        self._seed = 0 if seed is None else seed
        self.generator.manual_seed(self._seed)
        self._dev_generator: torch.Generator | None = None
        # Rows in sequence order, when the cache keeps them in another (see _sample).
        self._draw_order: torch.Tensor | None = None

    @property
    def cache(self):
        """The transformers cache the model reads and writes."""
        return self.kv if isinstance(self.kv, SlotCache) else self.kv.cache

    @property
    def cache_tokens(self) -> int:
        """The cache's width: the longest row (static) or the padded width (dynamic)."""
        return self.kv.width

    def fits(self, extra_tokens: int) -> bool:
        """Whether every sequence can grow by ``extra_tokens`` within the cache budget."""
        return self.kv.fits(extra_tokens)

    def drop(self, seq_ids: list[int]) -> None:
        """Remove finished sequences from the batch (their cache rows are freed)."""
        gone = set(seq_ids)
        kept = [i for i, s in enumerate(self.rows) if s not in gone]
        if len(kept) == len(self.rows):
            return
        order = self.kv.keep(kept)
        for name in ("rows", "next_pos", "lengths", "pending", "images_seen", "adapters"):
            values = getattr(self, name)
            setattr(self, name, [values[i] for i in order])

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
        self._hide_old_images()
        self._compact()
        # Room for the chunk (its padding included) and every decode step of the reply.
        self.kv.reserve(self.kv.width + width + params.max_tokens)
        attention_mask = self.kv.prefill(
            torch.from_numpy(mask_np).to(dev),
            torch.from_numpy(image_np).to(dev),
            [len(t) for t in token_lists],
        )
        extra = {}
        if pix:
            extra["pixel_values"] = as_patches(cat_pixels(pix), dev)
            extra["image_grid_thw"] = torch.cat(grids).to(dev)
        in_order = self.rows == sorted(self.rows)
        self._draw_order = (
            None if in_order else torch.tensor(np.argsort(self.rows), dtype=torch.long, device=dev)
        )
        logits = self._forward(
            torch.from_numpy(ids_np), torch.from_numpy(pos_np), attention_mask, **extra
        )
        return self._decode(logits, params)

    def _decode(self, logits: torch.Tensor, params: SamplingParams) -> dict[int, Generation]:
        """Sample the replies, one token a row per step, from the chunk's last logits."""
        eng, dev = self.engine, self.engine.device
        b = len(self.rows)
        gens = {seq: Generation() for seq in sorted(self.rows)}
        active = [True] * b
        active_dev = torch.ones(b, dtype=torch.bool, device=dev)
        next_pos: torch.Tensor | None = None
        for step in range(params.max_tokens):
            tokens_dev, tokens, logprobs = self._sample(logits, params)
            by_string = False
            for r, seq in enumerate(self.rows):
                if not active[r]:
                    continue
                g = gens[seq]
                g.token_ids.append(tokens[r])
                g.logprobs.append(logprobs[r])
                self.lengths[r] += 1
                self.pending[r] = tokens[r]
                if tokens[r] in eng.stop_token_ids:
                    g.finish_reason, active[r] = "stop", False
                elif self._hit_stop_string(g, params):
                    g.finish_reason, active[r], by_string = "stop", False, True
            if not any(active) or step == params.max_tokens - 1:
                break
            # The step's inputs on the device: each active row feeds its sampled token at its
            # next position; finished rows feed padding their cache never shows.
            active_dev = active_dev & ~torch.isin(tokens_dev, eng._stop_ids)
            if by_string:  # only the host saw those stops
                active_dev = torch.tensor(active, dtype=torch.bool, device=dev)
            if next_pos is None:
                next_pos = torch.tensor(self.next_pos, dtype=torch.long, device=dev)
            step_ids = torch.where(active_dev, tokens_dev, eng.chat.pad_id).view(b, 1)
            step_pos = torch.where(active_dev, next_pos, 0).view(1, b, 1).repeat(3, 1, 1)
            next_pos = next_pos + active_dev
            for r in range(b):
                if active[r]:
                    self.next_pos[r] += 1
                    self.pending[r] = None
            logits = self._forward(step_ids, step_pos, self.kv.decode(active_dev, active))
        return gens

    def _hide_old_images(self) -> None:
        """Mask the cache columns of images older than the last ``keep_last_k`` of each row."""
        if not self.keep_last_k:
            return
        seen = torch.tensor(self.images_seen, dtype=torch.long, device=self.engine.device)
        self.kv.hide_images(seen - self.keep_last_k)

    def _compact(self) -> None:
        """Drop the cache columns a row can no longer see (hidden images, padding).

        With ``keep_last_k_images`` most of a long episode's cache is old images: without
        this, every decode step would still read them. A copy, so only once they are a
        quarter of the width (``_COMPACT_WHEN_VISIBLE_BELOW``); the cached keys carry their
        rotary positions, so moving a column changes no logit (up to summation order).
        """
        self.kv.compact(_COMPACT_WHEN_VISIBLE_BELOW)

    def _hit_stop_string(self, g: Generation, params: SamplingParams) -> bool:
        if not params.stop:
            return False
        tail = self.engine.chat.decode(g.token_ids[-32:])
        return any(s in tail for s in params.stop)

    def _forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attention_mask: torch.Tensor,
        **extra,
    ) -> torch.Tensor:
        eng = self.engine
        dev = eng.device
        static = isinstance(self.kv, SlotCache)
        with (
            bf16_autocast(dev, eng.autocast),
            engine_attention(eng.model) if static else contextlib.nullcontext(),
            eng.lora.rows(self.adapters),
        ):
            out = eng.model(
                input_ids=input_ids.to(dev),
                attention_mask=attention_mask,
                position_ids=positions.to(dev),
                use_cache=True,
                logits_to_keep=1,
                **{eng._cache_kw: self.cache},
                **extra,
            )
        return mask_banned(out.logits[:, -1, :].float(), eng.banned_token_ids)

    def _sample(
        self, logits: torch.Tensor, params: SamplingParams
    ) -> tuple[torch.Tensor, list[int], list[float]]:
        """One token per row (on the device) and, as Python lists, the tokens and their
        logprobs (one device-to-host copy).

        Draws are made in sequence order: the static cache may keep rows in other slots
        (``SlotCache.keep``), and a seeded draw must not depend on where a row lives.
        """
        temperature = 1.0 if params.greedy else params.temperature
        if params.allowed_tokens:
            logits = keep_allowed(logits, self.engine.allowed_ids(params.allowed_tokens))
        logp = torch.log_softmax(logits / temperature, dim=-1)
        if params.greedy:
            tokens = logits.argmax(-1)
        else:
            order = self._draw_order
            drawn_from = logits if order is None else logits.index_select(0, order)
            probs = filter_logits(drawn_from / temperature, params.top_k, params.top_p).softmax(-1)
            if probs.device.type == "cpu":
                tokens = torch.multinomial(probs, 1, generator=self.generator).squeeze(-1)
            else:
                # On an accelerator the draw stays there: copying [rows, vocab] probabilities
                # to the host and drawing there was 1.5 s of a 10.5 s batch (profile_rollout).
                tokens = torch.multinomial(probs, 1, generator=self._device_generator()).squeeze(-1)
            if order is not None:
                tokens = torch.empty_like(tokens).index_copy_(0, order, tokens)
        picked = logp.gather(-1, tokens.view(-1, 1)).squeeze(-1)
        both = torch.stack([tokens.double(), picked.double()]).cpu()
        return tokens, [int(t) for t in both[0].tolist()], both[1].tolist()

    def _device_generator(self) -> torch.Generator:
        if self._dev_generator is None:
            self._dev_generator = torch.Generator(device=self.engine.device)
            self._dev_generator.manual_seed(self._seed)
        return self._dev_generator
