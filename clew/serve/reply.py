"""One reply as it streams: the tokens a row keeps, the text already sent, where it ends.

Stop strings are matched on the decoded text, never split across stream deltas: while a
row runs, the last ``len(longest stop) - 1`` characters (and a trailing partial UTF-8
character) are held back, and the reply is cut before the stop string, as OpenAI does. A
step of several tokens that completes a stop string, or runs past ``max_tokens``, keeps
only the tokens up to that point (the usage count excludes the rest).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass
class Reply:
    """The reply of one row so far; ``take`` each step's new tokens."""

    max_tokens: int
    stop: tuple[str, ...] = ()
    tokens: list[int] = field(default_factory=list)
    sent: int = 0  # characters of the reply already posted

    def take(
        self, token_ids: list[int], finish_reason: str | None, decode: Callable[[list[int]], str]
    ) -> tuple[str, str | None]:
        """The text to post now, and why the reply ended ("stop", "length") or None."""
        kept = token_ids[: self.max_tokens - len(self.tokens)]
        self.tokens.extend(kept)
        text = decode(self.tokens)
        # The engine's stop token ends the row only if it was not cut off by max_tokens.
        reason = "stop" if finish_reason == "stop" and len(kept) == len(token_ids) else None
        longest = max((len(s) for s in self.stop), default=0)
        start = max(0, self.sent - longest)
        cut = self._first_stop(text, start)
        if cut is not None:
            # Count the tokens up to the one that completed the stop string, not the rest
            # of a multi-token step.
            first_new = len(self.tokens) - len(kept)
            for j in range(first_new + 1, len(self.tokens)):
                if self._first_stop(decode(self.tokens[:j]), start) is not None:
                    del self.tokens[j:]
                    break
            text, reason = text[:cut], "stop"
        elif reason is None and len(self.tokens) >= self.max_tokens:
            reason = "length"
        end = len(text)
        if reason is None:
            end -= max(0, longest - 1)
            while end > self.sent and text[end - 1] == "\ufffd":
                end -= 1
        delta = text[self.sent : end] if end > self.sent else ""
        self.sent = max(self.sent, end)
        return delta, reason

    def _first_stop(self, text: str, start: int) -> int | None:
        """Where the earliest stop string begins in ``text`` (searching from ``start``)."""
        hits = [i for s in self.stop if (i := text.find(s, start)) >= 0]
        return min(hits) if hits else None
