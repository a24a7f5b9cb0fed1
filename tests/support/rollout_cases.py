"""Helpers the engine tests share: episodes that end at different turns, and comparing two
plays token for token."""

from __future__ import annotations

import itertools

import torch

from clew.envs import make


def ending_at_different_turns():
    """An env factory whose n-th episode ends after 1 + n % 4 turns, whatever the replies.

    Episodes are counted in the order the factory is called, which env threads make racy:
    plays that compare tokens use it with ``env_workers=1``."""
    count = itertools.count()

    def factory(env_id, **options):
        env = make(env_id, **options)
        last, steps = 1 + next(count) % 4, itertools.count(1)
        step = env.step

        def stepping(text):
            obs, reward, done, info = step(text)
            return obs, reward, done or next(steps) >= last, info

        env.step = stepping
        return env

    return factory


def assert_same_samples(a, b, tol: float = 1e-5) -> None:
    """The same tokens in every trajectory, and logprobs within ``tol``."""
    assert [t.token_ids for t in a] == [t.token_ids for t in b]
    worst = max(
        float((torch.tensor(x.logprobs) - torch.tensor(y.logprobs)).abs().max())
        for x, y in zip(a, b, strict=True)
    )
    assert worst < tol, f"largest logprob difference {worst:.2e}"
