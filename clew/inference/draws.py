"""Which random generator each row of an engine batch draws its tokens from.

A batch opened with a seed draws from one generator (``torch.multinomial`` over the rows'
filtered distributions), the rows taken in sequence order whatever cache slots they live in
(``SlotCache.keep`` moves rows), so a seeded batch samples the same tokens however its rows
are laid out. A row that joins a running batch with a seed of its own draws from a generator
of its own, one ``[1, vocab]`` draw a step: exactly the draws of a batch of that row alone
opened with that seed, and the batch generator's draws for the other rows are those they
would have made without it. A row that joins without a seed draws with the batch.

On an accelerator the draws stay there: copying ``[rows, vocab]`` probabilities to the host
and drawing there was a sizeable share of a rollout batch's time.
"""

from __future__ import annotations

import torch

from clew.inference.sampling import SamplingParams, filter_logits, scale_logits


class RowDraws:
    """The generators of one batch's rows, in cache row order."""

    def __init__(self, size: int, seed: int | None, device: torch.device) -> None:
        self.device = device
        self.seed = 0 if seed is None else seed
        self.generator = torch.Generator(device="cpu")
        self.generator.manual_seed(self.seed)
        self._device_generator: torch.Generator | None = None
        self.own: list[torch.Generator | None] = [None] * size  # None: the batch's generator
        # The batch generator's rows (cache indices) in sequence order; None: all, in order.
        self._order: torch.Tensor | None = None

    def join(self, n: int, seeds: list[int] | None) -> None:
        """``n`` rows appended; each with its own generator if ``seeds`` names one."""
        if seeds is None:
            self.own += [None] * n
            return
        for seed in seeds:
            generator = torch.Generator(device=self.device)
            generator.manual_seed(seed)
            self.own.append(generator)

    def keep(self, order: list[int]) -> None:
        """The rows now in each cache row (``SlotCache.keep``'s answer)."""
        self.own = [self.own[i] for i in order]

    def plan(self, seq_ids: list[int]) -> None:
        """Fix the draw order for the rows ``seq_ids`` (cache order) until the next plan."""
        shared = [r for r, g in enumerate(self.own) if g is None]
        if len(shared) == len(seq_ids) and seq_ids == sorted(seq_ids):
            self._order = None
            return
        by_seq = sorted(shared, key=lambda r: seq_ids[r])
        self._order = torch.tensor(by_seq, dtype=torch.long, device=self.device)

    def draw(self, logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
        """One token per row of ``logits`` [rows, vocab], each from its row's generator."""
        order = self._order
        if order is None:
            return self._draw(logits, params, self._shared(logits.device))
        tokens = torch.zeros(logits.shape[0], dtype=torch.long, device=logits.device)
        if len(order):
            drawn = self._draw(logits.index_select(0, order), params, self._shared(logits.device))
            tokens = tokens.index_copy(0, order, drawn)
        for r, own in enumerate(self.own):
            if own is not None:
                tokens[r] = self._draw(logits[r : r + 1], params, own)[0]
        return tokens

    @staticmethod
    def _draw(
        logits: torch.Tensor, params: SamplingParams, generator: torch.Generator
    ) -> torch.Tensor:
        scaled = scale_logits(logits, params.temperature)
        probs = filter_logits(scaled, params.top_k, params.top_p).softmax(-1)
        return torch.multinomial(probs, 1, generator=generator).squeeze(-1)

    def _shared(self, device: torch.device) -> torch.Generator:
        if device.type == "cpu":
            return self.generator
        if self._device_generator is None:
            self._device_generator = torch.Generator(device=device)
            self._device_generator.manual_seed(self.seed)
        return self._device_generator
