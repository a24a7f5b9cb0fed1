"""The rollout loop's env threads (``generator.env_workers``): how many, that they play
exactly what the loop's own thread plays, and that an env failing there fails only its
episodes."""

from __future__ import annotations

import os
import threading

import pytest
from support.tiny import tiny_policy

from clew.data.rows import generate_rows
from clew.envs import make
from clew.inference.engine import InferenceEngine
from clew.inference.sampling import SamplingParams
from clew.models import load_policy
from clew.models.chat import ChatFormat
from clew.rollout.env_threads import env_threads
from clew.rollout.loop import RolloutSettings, play


@pytest.fixture(scope="module")
def policy():
    model, processor = load_policy(tiny_policy(arch="qwen3_vl"))
    model.eval()
    return model, ChatFormat(processor)


@pytest.fixture(scope="module")
def rows():
    options = {"cell_px": 32, "action_format": "keyword"}
    return generate_rows("maze_2d/small", 3, env_options=options)


def _settings(**kw) -> RolloutSettings:
    sampling = SamplingParams(temperature=1.0, max_tokens=6)
    return RolloutSettings(n_samples_per_prompt=2, max_turns=4, sampling=sampling, **kw)


def test_env_workers_zero_means_one_thread_a_core_up_to_eight(monkeypatch):
    assert env_threads(3) == 3
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(64)), raising=False)
    assert env_threads(0) == 8
    monkeypatch.delattr(os, "sched_getaffinity", raising=False)  # as on macOS
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    assert env_threads(0) == 2


def test_env_threads_play_exactly_what_the_loop_thread_plays(policy, rows):
    model, chat = policy
    threads: set[str] = set()

    def factory(env_id, **options):
        env = make(env_id, **options)
        step = env.step

        def recording(text):
            threads.add(threading.current_thread().name)
            return step(text)

        env.step = recording
        return env

    def played(workers: int) -> list:
        threads.clear()
        settings = _settings(env_workers=workers, state_keys=True)
        return play(InferenceEngine(model, chat), rows, settings, seed=3, env_factory=factory)

    alone = played(1)
    assert threads == {threading.current_thread().name}
    pooled = played(4)
    assert threads and all(n.startswith("clew-env") for n in threads)
    for a, b in zip(alone, pooled, strict=True):
        assert (a.token_ids, a.logprobs, a.actions) == (b.token_ids, b.logprobs, b.actions)
        assert (a.reward, a.end_reason, a.state_keys) == (b.reward, b.end_reason, b.state_keys)


def test_an_env_that_cannot_reset_fails_only_its_episodes(policy, rows):
    model, chat = policy

    def factory(env_id, **options):
        env = make(env_id, **options)
        reset = env.reset

        def failing(seed):
            if seed == rows[0].seed:
                raise ValueError("no such maze")
            return reset(seed)

        env.reset = failing
        return env

    trajs = play(InferenceEngine(model, chat), rows, _settings(), seed=0, env_factory=factory)
    assert [(t.group_id, t.sample_index) for t in trajs] == [
        (g, s) for g in range(3) for s in (0, 1)
    ]
    assert [t.end_reason for t in trajs[:2]] == ["env_error"] * 2
    assert all("no such maze" in t.error and t.turns == 0 for t in trajs[:2])
    assert all(t.end_reason != "env_error" and t.turns > 0 for t in trajs[2:])
