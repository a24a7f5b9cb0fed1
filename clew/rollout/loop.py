"""The multi-turn agent loop: dataset rows in, finished trajectories out.

Every row is played ``n_samples`` times (one GRPO group per row, all on the row's seeded
maze). Episodes run in waves sized to the engine's cache budget (``_expected_length``: the
cache counts an episode by the length it is expected to reach); within a wave all episodes
advance turn by turn together, so each turn is one batched prefill plus one batched decode.
An episode ends on the env's ``done``, on ``max_turns`` (the smaller of
``generator.max_turns`` and the env's own budget), when its context would exceed
``max_input_length``, or when a turn would outgrow the cache budget (``cache_budget``:
finished cleanly, never an out-of-memory crash). An exception inside an env ends that
episode with reward 0 (``env_error``) and never takes down the batch.

Between two turns the GPU waits for every episode's env step and the encoding of its next
observation (a frame resized and cut into patches, its text tokenized). On one core that
was a large share of an 8B rollout's time at 192 episodes (BENCHMARKS.md), less since frames
the processor resizes take the fast path (``clew.models.pixels``), but still time the GPU
waits. ``env_workers`` threads do this per episode at once (Pillow and
numpy release the GIL for their work), and likewise start episodes (``START_AHEAD`` at a
time: env resets and first observations) before the waves admit them; each episode's
results are the same whichever thread ran it, and they are gathered in the episodes'
order. Envs are stepped from those threads, so two env instances must not share mutable
state (``env_workers=1`` steps them in the loop's thread).

``reply_prefix`` / ``reply_suffix`` fix the reply's format around what is sampled, as
structured-output decoding does: the prefix's tokens end every observation chunk (after
the assistant header), the suffix's tokens open the next chunk (before ``<|im_end|>``), so
they are context (no loss, no logprob) and the env reads ``prefix + sampled + suffix``.
With the keyword format (``<action>`` ... ``</action>``) and one sampled token a reply, a
turn is one forward pass instead of four: every decode step runs the whole batch, and the
format's tokens were three of the four.
"""

from __future__ import annotations

import functools
import itertools
import traceback
import weakref
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from clew.data.rows import Row
from clew.envs import make
from clew.errors import ConfigError
from clew.inference.engine import EngineOptions, InferenceEngine
from clew.inference.sampling import SamplingParams
from clew.models.chat import Chunk
from clew.rollout.env_threads import START_AHEAD, env_pool, env_threads
from clew.rollout.trajectory import (
    Trajectory,
    apply_reward_rule,
    hash_state_keys,
    observation_key,
)


@dataclass(frozen=True)
class RolloutSettings:
    """The generator settings the loop needs (from ``generator.*`` of the config)."""

    n_samples_per_prompt: int = 1
    max_turns: int = 20
    max_input_length: int = 8192
    sampling: SamplingParams = SamplingParams()
    keep_last_k_images: int | None = None
    reply_prefix: str = ""
    reply_suffix: str = ""
    # Record a state key per turn (Trajectory.state_keys) for per-turn credit (gigpo); off
    # otherwise: hashing every frame an env does not name adds host work (after the turns,
    # on threads).
    state_keys: bool = False
    # Keep each observation's Frames with its trajectory (``Trajectory.frames``) for a
    # training forward in the same process to read; off for evaluation, whose episodes
    # are not trained on (the frames would double the images' memory).
    keep_frames: bool = False
    # Threads that step the envs and encode their observations (module docstring); 0: one
    # per CPU core, at most ENV_WORKERS_MAX.
    env_workers: int = 0
    # How a finished episode's reward is computed from the env's and the replies
    # (clew.envs.rewards: "task", the env's own; "skyrl_visgym", the walkthrough's).
    reward_rule: str = "task"

    def reply_text(self, sampled: str, stopped: bool) -> str:
        """What the env reads for a reply: the prefix, the sampled text and, unless the
        reply closed itself (its stop token), the suffix."""
        return self.reply_prefix + sampled + ("" if stopped else self.reply_suffix)


@dataclass
class Episode:
    """One episode being played: its trajectory so far, its env and the env's turn budget."""

    traj: Trajectory
    env: Any
    max_turns: int


def start_episode(
    env_id: str,
    options: dict[str, Any],
    seed: int,
    group: int,
    sample: int,
    env_factory: Callable[..., Any] = make,
) -> tuple[Episode, Any]:
    """A new episode of ``env_id`` reset to ``seed``, and its first observation."""
    traj = Trajectory(env_id, options, seed, group, sample)
    env = env_factory(env_id, **options)
    obs = env.reset(seed)
    return Episode(traj, env, getattr(env, "max_turns", 1 << 30)), obs


def take_turn(ep: Episode, text: str, max_turns: int) -> Any | None:
    """Step ``ep``'s env with the reply ``text`` and record the turn in its trajectory.

    The next observation, or None when the episode ended: the env said done, the turn
    budget (the smaller of ``max_turns`` and the env's own) is spent, or the env raised
    (``env_error``, reward 0).
    """
    traj = ep.traj
    traj.actions.append(text)
    traj.turns += 1
    try:
        obs, reward, env_done, info = ep.env.step(text)
    except Exception as exc:
        fail_episode(traj, exc)
        return None
    traj.infos.append(info)
    traj.turn_rewards.append(float(reward))
    traj.reward = float(reward)
    if env_done:
        traj.end_reason = info.get("done_reason") or "stop"
        return None
    if traj.turns >= min(max_turns, ep.max_turns):
        traj.end_reason = "max_turns"
        return None
    return obs


def play(
    engine: InferenceEngine,
    rows: Sequence[Row],
    settings: RolloutSettings,
    *,
    seed: int = 0,
    env_factory: Callable[..., Any] = make,
    progress: Callable[[int], None] | None = None,
) -> list[Trajectory]:
    """Play every row ``n_samples_per_prompt`` times; trajectories in (row, sample) order."""
    chat = engine.chat
    framing = (chat.encode_text(settings.reply_prefix), chat.encode_text(settings.reply_suffix))
    # A row must be able to reach max_input_length alone (a ConfigError otherwise).
    engine.max_sequences(settings.max_input_length)
    n = settings.n_samples_per_prompt
    todo = [(g, s, row) for g, row in enumerate(rows) for s in range(n)][::-1]
    ready: deque[tuple[Episode, Any, Chunk]] = deque()  # started, not yet in a wave
    done: list[Trajectory] = []
    begin = functools.partial(
        first_turn, chat=chat, settings=settings, framing=framing, env_factory=env_factory
    )
    step = functools.partial(next_turn, chat=chat, settings=settings, framing=framing)
    with env_pool(env_threads(settings.env_workers)) as pool:
        for wave in itertools.count():
            episodes: dict[int, Episode] = {}
            chunks: dict[int, Chunk] = {}
            peak = 0  # the longest any episode of the wave is expected to grow
            while todo or ready:
                if not ready:  # start the next episodes together (env threads)
                    batch = [todo.pop() for _ in range(min(len(todo), START_AHEAD))]
                    for started in pool.map(begin, batch):
                        (done if isinstance(started, Trajectory) else ready).append(started)
                    continue
                ep, obs, chunk = ready[0]
                expected = _expected_length(engine, settings, ep, len(chunk.token_ids))
                if episodes and engine.max_sequences(max(peak, expected)) <= len(episodes):
                    break
                ready.popleft()
                peak = max(peak, expected)
                key = observation_key(obs) if settings.state_keys else None
                ep.traj.add_observation(chunk, obs.images, key, frames=settings.keep_frames)
                ep.traj.image_window = settings.keep_last_k_images
                ep.traj.wave = wave
                episodes[len(episodes)] = ep
                chunks[len(chunks)] = chunk
            if not episodes:
                break
            cached = engine.open_batch(
                len(episodes),
                seed=seed * 100_003 + wave,
                keep_last_k_images=settings.keep_last_k_images,
                capacity_hint=peak,
            )
            play_wave(cached, episodes, chunks, settings, pool.map, step, done, progress)
    done.sort(key=lambda t: (t.group_id, t.sample_index))
    with env_pool(env_threads(0)) as hashing:  # whatever env_workers is: hashing scales
        hash_state_keys(done, hashing.map)
    apply_reward_rule(done, settings.reward_rule)
    return done


def play_wave(
    cached: Any,
    episodes: dict[int, Episode],
    chunks: dict[int, Chunk],
    settings: RolloutSettings,
    map_: Callable[..., Iterator[Any]],
    step: Callable[[tuple[Episode, Any, int]], Chunk | None],
    done: list[Trajectory],
    progress: Callable[[int], None] | None,
) -> None:
    """Play a wave's ``episodes`` (their first ``chunks`` given) in ``cached``, turn by turn,
    to their ends; each finished trajectory goes to ``done``."""
    while episodes:
        # A turn that outgrows the budget ends as few episodes as it takes (the last
        # admitted first) with ``cache_budget``: finished cleanly, never out of memory.
        over: list[int] = []
        longest = max(len(c.token_ids) for c in chunks.values())
        while episodes and not cached.fits(longest + 1 + settings.sampling.max_tokens):
            last = max(episodes)
            episodes[last].traj.end_reason = "cache_budget"
            done.append(episodes.pop(last).traj)
            chunks.pop(last)
            cached.drop([last])
            over.append(last)
            longest = max((len(c.token_ids) for c in chunks.values()), default=0)
        if progress and over:
            progress(len(over))
        if not episodes:
            return
        gens = cached.extend_and_generate(chunks, settings.sampling)
        cache_row = {seq: r for r, seq in enumerate(cached.rows)}
        turns = [(episodes[i], g, cached.lengths[cache_row[i]]) for i, g in gens.items()]
        chunks.clear()
        finished = []
        for i, chunk in zip(gens, map_(step, turns), strict=True):
            if chunk is None:
                finished.append(i)
                done.append(episodes.pop(i).traj)
            else:
                chunks[i] = chunk
                _note_later_chunk(cached.engine, episodes[i].traj.env_id, len(chunk.token_ids))
        if progress and finished:
            progress(len(finished))
        cached.drop(finished)


def first_turn(
    spec: tuple[int, int, Row],
    *,
    chat: Any,
    settings: RolloutSettings,
    framing: tuple[list[int], list[int]],
    env_factory: Callable[..., Any],
) -> tuple[Episode, Any, Chunk] | Trajectory:
    """Episode ``spec`` (group, sample, row) started, run in the env threads: the episode,
    its first observation and that observation's chunk; or the failed trajectory of an env
    that cannot even reset."""
    g, s, row = spec
    try:
        ep, obs = start_episode(row.env_id, row.options(), int(row.seed), g, s, env_factory)
    except Exception as exc:  # noqa: BLE001 - that episode's failure, not the batch's
        traj = Trajectory(row.env_id, row.options(), int(row.seed), g, s)
        fail_episode(traj, exc)
        return traj
    chunk = _framed(chat.observation_turn(obs, first=True), [], framing[0])
    reply = settings.sampling.max_tokens
    if len(chunk.token_ids) + reply > settings.max_input_length:
        raise ConfigError(
            f"generator.max_input_length={settings.max_input_length} cannot hold one turn: "
            f"the first observation of {row.env_id} takes {len(chunk.token_ids)} tokens and a "
            f"reply up to {reply}; raise max_input_length to at least "
            f"{len(chunk.token_ids) + reply}"
        )
    return ep, obs, chunk


def next_turn(
    turn: tuple[Episode, Any, int],
    *,
    chat: Any,
    settings: RolloutSettings,
    framing: tuple[list[int], list[int]],
) -> Chunk | None:
    """One episode between two turns, run in the env threads: ``turn`` is the episode, its
    reply (a ``Generation``) and its length in the cache. The reply is recorded and the env
    stepped; returns the next observation's chunk, or None when the episode ended."""
    ep, gen, length = turn
    traj = ep.traj
    prefix, suffix = framing
    traj.add_reply(gen.token_ids, gen.logprobs)
    stopped = gen.finish_reason == "stop"  # a reply that closed itself gets no suffix
    text = settings.reply_text(chat.decode(gen.token_ids), stopped)
    obs = take_turn(ep, text, settings.max_turns)
    if obs is None:
        return None
    # A reply that stopped on another stop id (a generation_config eos such as
    # <|endoftext|>) is closed with <|im_end|> here, as the chat template closes every turn.
    closed = stopped and bool(gen.token_ids) and gen.token_ids[-1] == chat.im_end_id
    chunk = chat.observation_turn(obs, first=False, after_reply_end=closed)
    chunk = _framed(chunk, [] if stopped else suffix, prefix)
    if length + len(chunk.token_ids) + settings.sampling.max_tokens > settings.max_input_length:
        traj.end_reason = "context_full"
        return None
    key = observation_key(obs) if settings.state_keys else None
    traj.add_observation(chunk, obs.images, key, frames=settings.keep_frames)
    return chunk


def _expected_length(
    engine: InferenceEngine, settings: RolloutSettings, ep: Episode, first_chunk: int
) -> int:
    """The tokens the cache is sized for per episode when packing a wave.

    The cache counts rows by their real lengths: an episode is expected to grow by its first
    observation and a whole reply every turn (later observations carry no system prompt, so
    they are usually shorter), up to ``max_input_length``. Should a turn still outgrow the
    budget (observations that grow), it ends as few episodes as it takes with
    ``cache_budget``. Once the engine has played later turns of the env, those turns are
    counted by the longest such observation seen, with a quarter of headroom, instead of by
    the first (``_LATER_CHUNKS``): the second and later waves and steps pack more episodes.
    """
    turns = min(settings.max_turns, ep.max_turns)
    reply = settings.sampling.max_tokens + 1  # the reply and the pending token
    later = _LATER_CHUNKS.get(engine, {}).get(ep.traj.env_id)
    if later is None:  # nothing seen yet: every turn as long as the first
        return min(settings.max_input_length, turns * (first_chunk + reply))
    later += later // 4  # headroom for observations longer than any seen
    return min(settings.max_input_length, first_chunk + reply + (turns - 1) * (later + reply))


# Per engine and env id, the longest observation chunk after an episode's first one that
# the engine has played: later observations carry no instructions, so the first chunk is a
# poor measure of them (on maze_2d/easy 289 tokens against about 120).
_LATER_CHUNKS: weakref.WeakKeyDictionary[InferenceEngine, dict[str, int]] = (
    weakref.WeakKeyDictionary()
)


def _note_later_chunk(engine: InferenceEngine, env_id: str, tokens: int) -> None:
    seen = _LATER_CHUNKS.setdefault(engine, {})
    seen[env_id] = max(seen.get(env_id, 0), tokens)


def play_model(
    model: Any,
    chat: Any,
    rows: Sequence[Row],
    settings: RolloutSettings,
    *,
    seed: int = 0,
    autocast: bool = False,
    engine: EngineOptions | None = None,
) -> list[Trajectory]:
    """``play`` with a model being trained (SFT's evaluations, DAgger rounds): the episodes
    run in eval mode and the model's mode is restored after. ``engine``: the run's engine
    options (``generator.inference_engine``: cache, CUDA graphs, attention, budget); without
    them, the engine's own defaults, eager and with no cache budget."""
    was_training = model.training
    model.eval()
    try:
        if engine is None:
            built = InferenceEngine(model, chat, autocast=autocast)
        else:
            built = engine.build(model, chat, autocast=autocast)
        return play(built, rows, settings, seed=seed)
    finally:
        model.train(was_training)


def _framed(chunk: Chunk, before: list[int], after: list[int]) -> Chunk:
    """``chunk`` with the previous reply's forced ending before it and the next one's opening after."""
    if not before and not after:
        return chunk
    return Chunk(before + chunk.token_ids + after, chunk.pixel_values, chunk.image_grid_thw)


def fail_episode(traj: Trajectory, exc: BaseException) -> None:
    """End ``traj`` as ``env_error`` with reward 0, keeping the error's one-line summary."""
    traj.reward = 0.0
    traj.end_reason = "env_error"
    traj.error = "".join(traceback.format_exception_only(type(exc), exc)).strip()
