"""One engine batch: sequences sharing one KV cache, extended turn by turn, rows joining late.

A ``CacheBatch`` (``InferenceEngine.open_batch``) holds its rows in cache order; a row is
addressed by its sequence id (``0 .. size-1`` at opening, the next ids for rows that join).
Each ``extend_and_generate`` appends a chunk to every row (its pending token, if any, plus
the chunk's tokens), prefills them left-padded to one width and decodes a reply per row, one
token a row per step; finished rows leave with ``drop``. On a GPU (``engine.pack_prefill``)
the prefill runs the real tokens alone instead, row after row in one sequence of a batch of
one: the cache writes each token at its row's column, the attention reads each row by its
length (``prefill_lengths(starts=)``) and the logits of each row's last token come out
(``logits_to_keep`` as positions). It needs an attention that reads rows by their lengths
(``prefill_attention`` triton or varlen), so a forward with ``sdpa``, while images are
hidden, or with per-row adapters, stays padded. With the engine's ``prefill_graphs``, a
whole batch's prefill without per-row adapters is padded, images hidden or not, and replays
its language-model layers from CUDA graphs (``clew.inference.prefill_graphs``): for the small
policies graphs are for, one replay costs less host time than the packed layers' launches.

Joining (continuous batching): ``add_rows`` puts new rows into free slots of the running
batch between two ``extend_and_generate`` calls, and the next call prefills
their prompts while the other rows feed their pending token. That step runs two forwards,
the running rows' one column each and the new rows' prompts, rather than one forward of
every row padded to the longest prompt: under steady load a few rows join a batch of many
at most steps, and padding every running row to a prompt's width (an image is dozens of
tokens) would make each such step cost a whole batch's prefill. The two forwards' last
logits are sampled together and the reply is decoded as one batch from there. The split
applies when the new rows (those with nothing in the cache yet) are the batch's last rows,
which they are unless rows left between ``add_rows`` and the step; otherwise the one padded
forward runs, which gives the same tokens.

Seeded draws (``clew.inference.draws``): rows opened with the batch draw from its generator
in sequence order; a row that joins with a seed of its own (``add_rows(seeds=)``) draws what
it would alone, and the running rows draw what they would without it.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch

from clew.errors import ConfigError
from clew.inference.attention import engine_attention
from clew.inference.chunks import Prefill, pack
from clew.inference.cuda_graphs import DecodeGraphs
from clew.inference.draws import RowDraws
from clew.inference.kv_cache import SlotCache
from clew.inference.prefill_graphs import CHUNK_WIDTH_STEP, routed
from clew.inference.sampling import SamplingParams
from clew.kernels.fused_pointwise import pointwise_fused
from clew.kernels.sdpa_backends import without_cudnn_attention
from clew.kernels.slot_views import prefill_lengths
from clew.models.chat import Chunk
from clew.models.distinct_images import images_deduplicated
from clew.models.logit_masks import keep_allowed, mask_banned
from clew.models.pixels import as_patches, cat_pixels
from clew.models.positions import mrope_positions
from clew.models.precision import bf16_autocast

if TYPE_CHECKING:
    from clew.inference.engine import InferenceEngine

# CacheBatch._compact runs once the visible columns are at most this share of the cache width.
_COMPACT_WHEN_VISIBLE_BELOW = 0.75


@dataclass
class Generation:
    """One sampled reply: ids and logprobs per token, and why it ended (stop|length)."""

    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish_reason: str = "length"


class CacheBatch:
    """A batch of sequences sharing one KV cache (module docstring)."""

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
        self.kv = SlotCache(
            engine.num_layers,
            size,
            dev,
            capacity_hint=capacity_hint,
            bytes_per_token=engine.bytes_per_token,
            budget_bytes=engine.max_cache_bytes,
            store=engine.kv_store,
        )
        self.images_seen = [0] * size
        self.rows: list[int] = list(range(size))  # sequence ids, in cache row order
        self.next_pos = [0] * size
        self.lengths = [0] * size  # real tokens per sequence (fed + pending)
        self.pending: list[int | None] = [None] * size
        self.adapters: list[str | None] = [None] * size  # each row's adapter, None: the base
        self.draws = RowDraws(size, seed, dev)
        self._next_seq = size
        # Decode steps from CUDA graphs (clew.inference.cuda_graphs). Under autocast the
        # forwards cast without autocast's cache (_forward), so a graph records the casts of
        # the float32 adapters and replays them over their new values.
        self.graphs: DecodeGraphs | None = None
        if engine.cuda_graphs:
            self.graphs = DecodeGraphs(
                self.kv,
                engine.chat.pad_id,
                capture=dev.type == "cuda",
                attention=engine.decode_attention,
            )

    @property
    def cache_tokens(self) -> int:
        """The cache's width: its longest row."""
        return self.kv.width

    def fits(self, extra_tokens: int) -> bool:
        """Whether every sequence can grow by ``extra_tokens`` within the cache budget."""
        return self.kv.fits(extra_tokens)

    def can_add(self, n: int, tokens: int) -> bool:
        """Whether ``n`` rows of up to ``tokens`` tokens each can join within the budget."""
        return self.kv.fits_joining(n, tokens)

    def add_rows(
        self,
        n: int,
        adapters: list[str | None] | None = None,
        seeds: list[int] | None = None,
        tokens: int = 0,
    ) -> list[int]:
        """``n`` new rows (their sequence ids) that the next ``extend_and_generate`` prefills
        while the others continue; ``adapters``: each one's (None: the base); ``seeds``: each
        one's own draws (module docstring); ``tokens``: the longest a new row may grow."""
        if seeds is not None and len(seeds) != n:
            raise ConfigError(f"{n} joining rows need {n} seeds, got {len(seeds)}")
        names = self.engine.lora.check_rows(adapters, n)
        if not self.kv.fits_joining(n, tokens):
            raise ConfigError(
                f"{n} more row(s) of {tokens} tokens do not fit this batch's KV-cache budget "
                f"beside its {len(self.rows)} row(s); wait for rows to finish"
            )
        self.kv.add_rows(n)
        ids = list(range(self._next_seq, self._next_seq + n))
        self._next_seq += n
        self.rows += ids
        self.next_pos += [0] * n
        self.lengths += [0] * n
        self.pending += [None] * n
        self.images_seen += [0] * n
        self.adapters += names
        self.draws.join(n, seeds)
        return ids

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
        self.draws.keep(order)

    @torch.no_grad()
    def extend_and_generate(
        self, chunks: dict[int, Chunk], params: SamplingParams
    ) -> dict[int, Generation]:
        """Append ``chunks[seq]`` to every sequence in the batch and sample one reply each."""
        if set(chunks) != set(self.rows):
            raise ValueError("every sequence in the batch needs a chunk (drop finished ones first)")
        chat = self.engine.chat
        b = new = len(self.rows)
        # Rows with nothing in the cache yet, when they are the last: prefilled on their own.
        while new > 0 and self.lengths[new - 1] == 0:
            new -= 1
        token_lists: list[list[int]] = []
        pos_lists: list[torch.Tensor | int] = []
        for r, seq in enumerate(self.rows):
            chunk = chunks[seq]
            ids = ([self.pending[r]] if self.pending[r] is not None else []) + chunk.token_ids
            if len(ids) == 1 and ids[0] != chat.image_token_id:
                # One text token (a running row's step): its position on all three axes.
                pos, self.next_pos[r] = self.next_pos[r], self.next_pos[r] + 1
            else:
                pos, self.next_pos[r] = mrope_positions(
                    ids,
                    chunk.image_grid_thw,
                    self.next_pos[r],
                    chat.image_token_id,
                    chat.merge_size,
                )
            token_lists.append(ids)
            pos_lists.append(pos)
            self.lengths[r] += len(chunk.token_ids)
            self.pending[r] = None
        split = 0 < new < b and any(token_lists[:new])
        spans = [(0, new), (new, b)] if split else [(0, b)]
        # A graph is captured per chunk width: widths rounded up keep their number small.
        step = CHUNK_WIDTH_STEP if self.engine.prefill_graphs is not None else 1
        parts = []
        for lo, hi in spans:
            row_chunks = [chunks[seq] for seq in self.rows[lo:hi]]
            part, self.images_seen[lo:hi] = pack(
                self.engine.chat, token_lists[lo:hi], pos_lists[lo:hi], row_chunks,
                self.images_seen[lo:hi], lo, step,
            )  # fmt: skip
            parts.append(part)
        self._hide_old_images()
        self._compact()
        # Room for the chunk (its padding included) and every decode step of the reply.
        width = max(p.ids.shape[1] for p in parts)
        self.kv.reserve(self.kv.width + width + params.max_tokens)
        self.draws.plan(self.rows)
        logits = torch.cat([self._prefill(p) for p in parts])
        return self._decode(logits, params)

    def _prefill(self, part: Prefill) -> torch.Tensor:
        """One forward of ``part``'s rows; their last logits ``[rows, vocab]``."""
        dev = self.engine.device
        mask, image = torch.from_numpy(part.mask).to(dev), torch.from_numpy(part.image).to(dev)
        whole = (part.lo, part.hi) == (0, len(self.rows))
        # The layers from a CUDA graph (clew.inference.prefill_graphs): a whole batch's padded
        # prefill with no per-row adapters, whatever the attention by length would have run.
        graphs = self.engine.prefill_graphs if whole and not any(self.adapters) else None
        by_length = (
            graphs is None
            and self.engine.prefill_attention in ("varlen", "triton")
            and not self.kv.hidden_any  # a row's visible columns are then its first `fill`
        )
        # Packed: the real tokens alone, row after row in one sequence (no padding computed);
        # per-row adapters select by batch row, so those forwards stay padded.
        packed = (
            by_length and self.engine.pack_prefill and not any(self.adapters[part.lo : part.hi])
        )
        attention_mask = self.kv.prefill(mask, image, part.counts, part.lo, packed)
        extra = {}
        if part.pixels:
            extra["pixel_values"] = as_patches(cat_pixels(part.pixels), dev)
            extra["image_grid_thw"] = torch.cat(part.grids).to(dev)
        if not whole:
            extra["rows"] = slice(part.lo, part.hi)
        lengths = self.kv.fill_dev[part.lo : part.hi] if by_length else None
        if packed:
            return self._packed_forward(part, lengths, extra)
        ids, pos = torch.from_numpy(part.ids), torch.from_numpy(part.pos)
        if graphs is not None:
            with routed(graphs, self.engine.model, self.kv, self.engine._cache_kw):
                return self._forward(ids, pos, attention_mask, **extra)
        with (
            prefill_lengths(lengths, self.engine.prefill_attention)
            if by_length
            else contextlib.nullcontext()
        ):
            return self._forward(ids, pos, attention_mask, **extra)

    def _packed_forward(self, part: Prefill, lengths: torch.Tensor, extra: dict) -> torch.Tensor:
        """``part``'s real tokens as one sequence of a batch of one (the cache's write and the
        attention planned by row: ``SlotCache.prefill(packed=True)``, ``prefill_lengths``);
        the last logits of each row ``[rows, vocab]``."""
        dev = self.engine.device
        real = part.mask.astype(bool)
        ids = torch.from_numpy(part.ids[real][None])
        pos = torch.from_numpy(part.pos[:, real][:, None])
        bounds = np.concatenate([[0], np.cumsum(part.counts)])
        starts = torch.from_numpy(bounds.astype(np.int32)).to(dev)
        ends = torch.from_numpy(bounds[1:] - 1).to(dev)  # each row's last token
        # A 4D mask is passed through as it is; the attention reads the lengths instead.
        no_mask = torch.ones(1, 1, 1, 1, dtype=torch.bool, device=dev)
        with prefill_lengths(lengths, self.engine.prefill_attention, starts, max(part.counts)):
            return self._forward(ids, pos, no_mask, keep=ends, **extra)

    def _decode(self, logits: torch.Tensor, params: SamplingParams) -> dict[int, Generation]:
        """Sample the replies, one token a row per step, from the chunk's last logits.

        Each step's tokens come to the host in one copy; which rows go on is read from them
        and the next step is launched before the host records the replies (its Python work
        per row then runs while the device computes). Stop strings need each reply's text
        first: with ``params.stop`` the host records, then launches."""
        eng, dev = self.engine, self.engine.device
        b = len(self.rows)
        gens = {seq: Generation() for seq in sorted(self.rows)}
        active = [True] * b
        active_dev = torch.ones(b, dtype=torch.bool, device=dev)
        next_pos: torch.Tensor | None = None
        stops = eng.stop_token_ids
        for step in range(params.max_tokens):
            last = step == params.max_tokens - 1
            tokens_dev, sampled = self._sample(logits, params)
            tokens, logprobs = [int(t) for t in sampled[0].tolist()], sampled[1].tolist()
            before = active
            if params.stop:
                active = self._record(gens, before, tokens, logprobs, params)
                active_dev = torch.tensor(active, dtype=torch.bool, device=dev)
            else:
                active = [a and t not in stops for a, t in zip(before, tokens, strict=True)]
                active_dev = active_dev & ~torch.isin(tokens_dev, eng._stop_ids)
            if any(active) and not last:
                # Each active row feeds its sampled token at its next position; finished rows
                # feed padding their cache never shows.
                step_ids, step_pos, next_pos = self._step_inputs(tokens_dev, active_dev, next_pos)
                logits = self._step(step_ids, step_pos, active_dev, active)
            if not params.stop:
                self._record(gens, before, tokens, logprobs, params)
            if not any(active) or last:
                break
            for r, on in enumerate(active):  # the host side of the step: the row fed its token
                if on:
                    self.next_pos[r] += 1
                    self.pending[r] = None
        return gens

    def _step(
        self, ids: torch.Tensor, pos: torch.Tensor, active: torch.Tensor, active_host: list[bool]
    ) -> torch.Tensor:
        """Launch one decode step of every row; its logits (computed on the device)."""
        if self.graphs is not None and not any(self.adapters):
            return self.graphs.step(ids, pos, active, active_host, self._forward)
        # An eager step's tensors are a row each: a compiled kernel's call costs more host
        # time than the kernels it replaces (clew.kernels.fused_pointwise), so eager steps leave
        # them out: a GRPO rollout's eager steps were measured slower with them (BENCHMARKS.md).
        return self._forward(ids, pos, self.kv.decode(active, active_host), fused=False)

    def _record(
        self,
        gens: dict[int, Generation],
        before: list[bool],
        tokens: list[int],
        logprobs: list[float],
        params: SamplingParams,
    ) -> list[bool]:
        """Append the token and logprob of each row active ``before`` the step; returns the
        rows still active (no stop token, no stop string)."""
        active = list(before)
        for r, seq in enumerate(self.rows):
            if not before[r]:
                continue
            g = gens[seq]
            g.token_ids.append(tokens[r])
            g.logprobs.append(logprobs[r])
            self.lengths[r] += 1
            self.pending[r] = tokens[r]
            if tokens[r] in self.engine.stop_token_ids or self._hit_stop_string(g, params):
                g.finish_reason, active[r] = "stop", False
        return active

    def _step_inputs(
        self, tokens: torch.Tensor, active: torch.Tensor, next_pos: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """A decode step's ids [rows, 1] and positions [3, rows, 1], and the positions after
        it: active rows feed their token at their next position, the others padding."""
        if next_pos is None:
            next_pos = torch.tensor(self.next_pos, dtype=torch.long, device=self.engine.device)
        b = tokens.shape[0]
        step_ids = torch.where(active, tokens, self.engine.chat.pad_id).view(b, 1)
        step_pos = torch.where(active, next_pos, 0).view(1, b, 1).repeat(3, 1, 1)
        return step_ids, step_pos, next_pos + active

    def _hide_old_images(self) -> None:
        """Mask the cache columns of images older than the last ``keep_last_k`` of each row."""
        if not self.keep_last_k or max(self.images_seen, default=0) <= self.keep_last_k:
            return  # nothing to hide yet: the cache keeps reading rows by their lengths
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
        rows: slice | None = None,
        fused: bool = True,
        keep: torch.Tensor | None = None,
        **extra,
    ) -> torch.Tensor:
        """The last logits of a forward of every row, or of ``rows`` (a prefill's slots);
        ``fused=False`` leaves the fused element-wise kernels out even where they are on;
        ``keep``: the positions of a packed forward's rows' last tokens, whose logits are
        returned instead.

        The engine's model-side paths are on for this forward only, in this thread (the
        trainer's forwards of the same model keep transformers' code): its attention, the
        fused element-wise kernels where on, each distinct image through the vision tower
        once (``clew.models.distinct_images``), through the vision graphs where the engine has
        them (``clew.inference.vision_graphs``), and each row's adapter."""
        eng = self.engine
        dev = eng.device
        adapters = self.adapters if rows is None else self.adapters[rows]
        with (
            bf16_autocast(dev, eng.autocast, cache=False),
            engine_attention(eng.model),
            pointwise_fused(eng.fused_pointwise and fused),
            images_deduplicated(),
            eng.vision_graphs.routed() if eng.vision_graphs else contextlib.nullcontext(),
            eng.lora.rows(adapters),
            without_cudnn_attention(),
        ):
            out = eng.model(
                input_ids=input_ids.to(dev),
                attention_mask=attention_mask,
                position_ids=positions.to(dev),
                use_cache=True,
                logits_to_keep=1 if keep is None else keep,
                **{eng._cache_kw: self.kv},
                **extra,
            )
        logits = out.logits[:, -1, :] if keep is None else out.logits[0]
        return mask_banned(logits.float(), eng.banned_token_ids)

    def _sample(
        self, logits: torch.Tensor, params: SamplingParams
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One token per row (on the device) and, on the host, the tokens and their logprobs
        ``[2, rows]`` float64 (one device-to-host copy).

        Which generator each row draws from, and in which order, is ``self.draws``'s.
        """
        temperature = 1.0 if params.greedy else params.temperature
        if params.allowed_tokens:
            logits = keep_allowed(logits, self.engine.allowed_ids(params.allowed_tokens))
        logp = torch.log_softmax(logits / temperature, dim=-1)
        tokens = logits.argmax(-1) if params.greedy else self.draws.draw(logits, params)
        picked = logp.gather(-1, tokens.view(-1, 1)).squeeze(-1)
        return tokens, torch.stack([tokens.double(), picked.double()]).cpu()
