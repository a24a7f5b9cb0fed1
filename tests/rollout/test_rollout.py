"""The rollout engine and the multi-turn loop on the tiny model: exact tokens, exact logprobs."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from support.tiny import tiny_policy

from clew.algorithms import turn_token_advantages
from clew.data.rows import generate_rows
from clew.envs import make
from clew.errors import ConfigError
from clew.inference.engine import InferenceEngine
from clew.inference.sampling import SamplingParams
from clew.models import load_policy
from clew.models.chat import ChatFormat
from clew.models.positions import sequence_positions
from clew.rollout.env_threads import env_pool
from clew.rollout.episode_stats import rollout_metrics
from clew.rollout.evaluation import eval_metrics, evaluate
from clew.rollout.loop import RolloutSettings, play
from clew.rollout.trajectory import (
    PendingKey,
    Trajectory,
    hash_state_keys,
    observation_key,
    state_key,
)

OPTIONS = {"cell_px": 28, "action_format": "keyword"}


@pytest.fixture(scope="module")
def policy():
    model, processor = load_policy(tiny_policy(image_size=196))
    model.eval()
    return model, ChatFormat(processor)


@pytest.fixture(scope="module")
def rows():
    return generate_rows("maze_2d/small", 3, env_options=OPTIONS)


def _settings(**kw) -> RolloutSettings:
    base = {"n_samples_per_prompt": 2, "max_turns": 4, "max_input_length": 4096}
    sampling = SamplingParams(temperature=1.0, max_tokens=kw.pop("max_tokens", 6))
    return RolloutSettings(**{**base, **kw}, sampling=sampling)


def _full_forward_logprobs(model, chat, traj) -> torch.Tensor:
    """Logprobs of every next token by one plain forward pass, with transformers' own positions."""
    ids = torch.tensor([traj.token_ids])
    pixel_values, grid = traj.vision_inputs(chat)
    mm = (ids == chat.image_token_id).int()
    with torch.no_grad():
        out = model(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            pixel_values=pixel_values,
            image_grid_thw=grid,
            mm_token_type_ids=mm,
        )
    logits = out.logits[0, :-1].float()
    banned = InferenceEngine(model, chat).banned_token_ids
    logits[:, banned] = float("-inf")
    return torch.log_softmax(logits, -1).gather(-1, ids[0, 1:, None]).squeeze(-1)


def test_kv_reused_logprobs_match_a_full_recompute(policy, rows):
    model, chat = policy
    trajs = play(InferenceEngine(model, chat), rows, _settings(), seed=3)
    worst = 0.0
    for t in trajs:
        assert t.turns >= 2
        recomputed = _full_forward_logprobs(model, chat, t)
        mask = torch.tensor(t.loss_mask[1:], dtype=torch.bool)
        sampled = torch.tensor(t.logprobs[1:])[mask]
        worst = max(worst, float((recomputed[mask] - sampled).abs().max()))
    assert worst < 1e-4, f"largest logprob difference {worst:.2e}"


def test_engine_positions_equal_transformers_rope_index(policy, rows):
    model, chat = policy
    traj = play(InferenceEngine(model, chat), rows[:1], _settings(n_samples_per_prompt=1), seed=0)[
        0
    ]
    ids = torch.tensor([traj.token_ids])
    _, grid = traj.vision_inputs(chat)
    theirs, _ = model.model.get_rope_index(
        ids,
        mm_token_type_ids=(ids == chat.image_token_id).int(),
        image_grid_thw=grid,
        attention_mask=torch.ones_like(ids),
    )
    ours = sequence_positions(traj.token_ids, grid, chat.image_token_id, chat.merge_size)
    assert torch.equal(ours, theirs[:, 0])


def test_positions_of_text_and_one_image_and_a_grid_mismatch():
    img = 9  # the image token id; a 2x4 grid with merge 2 gives 1x2 = 2 image tokens
    grid = torch.tensor([[1, 2, 4]])
    pos = sequence_positions([5, 5, img, img, 5], grid, img, 2)
    assert pos.tolist() == [[0, 1, 2, 2, 4], [0, 1, 2, 2, 4], [0, 1, 2, 3, 4]]
    with pytest.raises(ValueError, match="image tokens"):
        sequence_positions([5, img, img, img], grid, img, 2)


def test_loss_mask_marks_exactly_the_sampled_tokens(policy, rows):
    model, chat = policy
    trajs = play(InferenceEngine(model, chat), rows, _settings(state_keys=True), seed=1)
    for t in trajs:
        assert len(t.token_ids) == len(t.loss_mask) == len(t.logprobs)
        generated = [tok for tok, m in zip(t.token_ids, t.loss_mask, strict=True) if m]
        # Token out: the replies the env saw are the decoded sampled ids, in order.
        replies = []
        run: list[int] = []
        for tok, m in zip(t.token_ids, t.loss_mask, strict=True):
            if m:
                run.append(tok)
            elif run:
                replies.append(run)
                run = []
        if run:
            replies.append(run)
        assert [chat.decode(r) for r in replies] == t.actions
        # One reward and one state per turn, for per-turn credit (gigpo).
        assert len(t.turn_rewards) == len(t.state_keys) == t.turns == len(replies)
        spread = turn_token_advantages(torch.arange(1.0, t.turns + 1), t.loss_mask)
        assert spread[torch.tensor(t.loss_mask, dtype=torch.bool)].unique().tolist() == list(
            range(1, t.turns + 1)
        )
        assert len(generated) == t.generated_tokens
        assert all(lp == 0.0 for lp, m in zip(t.logprobs, t.loss_mask, strict=True) if not m)
        assert all(lp <= 0.0 for lp, m in zip(t.logprobs, t.loss_mask, strict=True) if m)


def test_state_keys_name_each_turns_observation_and_group_turns_as_its_frame_does(policy, rows):
    model, chat = policy
    trajs = play(InferenceEngine(model, chat), rows, _settings(state_keys=True), seed=1)
    by_key, by_frame = {}, {}
    for t in trajs:
        # The frame each turn acted from is the observation's image before it: replay the env.
        env = make(t.env_id, **t.env_options)
        obs, want = env.reset(t.seed), []
        for action in t.actions:
            assert obs.state is not None  # the maze names its states
            want.append(obs.state)
            digest = state_key(obs.images, obs.text)
            by_key.setdefault((t.group_id, obs.state), set()).add(digest)
            by_frame.setdefault((t.group_id, digest), set()).add(obs.state)
            obs, *_ = env.step(action)
        assert t.state_keys == want
    # Within a group, one key is one frame and one frame one key: the digest's grouping.
    assert all(len(v) == 1 for v in by_key.values())
    assert all(len(v) == 1 for v in by_frame.values())


def test_an_observation_without_a_state_name_is_keyed_by_its_frames_digest(rows):
    env = make(rows[0].env_id, **rows[0].options())
    obs = env.reset(int(rows[0].seed))
    named = observation_key(obs)
    pending = observation_key(dataclasses.replace(obs, state=None))
    assert named == obs.state and isinstance(pending, PendingKey)
    t = Trajectory("e", {}, 0, 0, 0)
    t.state_keys.append(pending)
    hash_state_keys([t], map)
    assert t.state_keys == [state_key(obs.images, obs.text)]


def test_hashing_pending_keys_on_threads_gives_the_keys_hashed_in_order(rows):
    env = make(rows[0].env_id, **rows[0].options())
    frames = [env.reset(int(r.seed)) for r in rows for _ in range(3)]
    for threads in (1, 2, 5):
        trajs = [Trajectory("e", {}, 0, 0, i) for i in range(3)]
        for n, obs in enumerate(frames):
            trajs[n % 3].state_keys.append(PendingKey(obs.images, obs.text))
        with env_pool(threads) as pool:
            hash_state_keys(trajs, pool.map)
        assert [k for t in trajs for k in t.state_keys] == [
            state_key(obs.images, obs.text) for i in range(3) for obs in frames[i::3]
        ]


def _assert_seeded(engine, rows) -> list:
    a = play(engine, rows, _settings(), seed=7)
    b = play(engine, rows, _settings(), seed=7)
    c = play(engine, rows, _settings(), seed=8)
    assert [t.token_ids for t in a] == [t.token_ids for t in b]
    assert [t.token_ids for t in a] != [t.token_ids for t in c]
    return a


def test_same_seed_same_samples_and_other_seed_differs(policy, rows):
    model, chat = policy
    _assert_seeded(InferenceEngine(model, chat), rows)


def test_greedy_samples_of_a_group_are_identical(policy, rows):
    model, chat = policy
    settings = RolloutSettings(2, 3, 4096, SamplingParams(temperature=0.0, max_tokens=5))
    trajs = play(InferenceEngine(model, chat), rows[:1], settings, seed=0)
    assert trajs[0].token_ids == trajs[1].token_ids
    assert trajs[0].state_keys == []  # frames are hashed only when asked (state_keys)


class _Exploding:
    """An env that raises on its second step, to show one failure never takes down the batch."""

    def __init__(self, **options):
        self.inner = make("maze_2d/small", **options)
        self.max_turns = self.inner.max_turns
        self.steps = 0

    def reset(self, seed):
        self.seed = seed
        return self.inner.reset(seed)

    def step(self, text):
        self.steps += 1
        if self.seed == self.bad_seed and self.steps == 2:
            raise RuntimeError("simulated env crash")
        return self.inner.step(text)


def test_env_exception_ends_only_that_episode_with_zero_reward(policy, rows):
    model, chat = policy

    def factory(env_id, **options):
        env = _Exploding(**options)
        env.bad_seed = rows[1].seed
        return env

    trajs = play(InferenceEngine(model, chat), rows, _settings(), seed=0, env_factory=factory)
    bad = [t for t in trajs if t.seed == rows[1].seed]
    good = [t for t in trajs if t.seed != rows[1].seed]
    assert all(
        t.end_reason == "env_error" and t.reward == 0 and "simulated" in t.error for t in bad
    )
    assert all(t.end_reason != "env_error" and t.turns == 4 for t in good)
    assert rollout_metrics(trajs, "train")["train/env_errors"] == 2


def test_event_shares_count_every_turn_by_what_the_env_reported(policy, rows):
    model, chat = policy
    trajs = play(InferenceEngine(model, chat), rows, _settings(), seed=2)
    metrics = rollout_metrics(trajs, "train")
    shares = {k: v for k, v in metrics.items() if k.startswith("train/event/")}
    assert shares and abs(sum(shares.values()) - 1.0) < 1e-9
    walls = sum(i["event"] == "wall" for t in trajs for i in t.infos)
    turns = sum(len(t.infos) for t in trajs)
    assert metrics.get("train/event/wall", 0.0) == walls / turns
    parse_errors = sum(t.parse_errors for t in trajs)
    assert metrics.get("train/event/parse_error", 0.0) * turns == pytest.approx(parse_errors)


def test_cache_budget_finishes_episodes_cleanly(policy, rows):
    model, chat = policy
    engine = InferenceEngine(model, chat)
    one_turn = 600 * engine.bytes_per_token
    engine.max_cache_bytes = one_turn * 2  # room for two sequences' first turns, not more
    trajs = play(engine, rows, _settings(max_input_length=600), seed=0)
    assert len(trajs) == 6
    assert {t.end_reason for t in trajs} <= {"cache_budget", "context_full", "max_turns"}
    engine.max_cache_bytes = 10 * engine.bytes_per_token
    with pytest.raises(ConfigError, match="cannot hold one sequence"):
        play(engine, rows, _settings(), seed=0)


def test_context_smaller_than_one_turn_is_refused(policy, rows):
    model, chat = policy
    with pytest.raises(ConfigError, match="cannot hold one turn"):
        play(InferenceEngine(model, chat), rows, _settings(max_input_length=50), seed=0)


def test_eval_reports_pass_at_1_and_dumps_trajectories(policy, rows, tmp_path):
    model, chat = policy
    settings = RolloutSettings(1, 3, 4096, SamplingParams(temperature=0.0, max_tokens=5))
    metrics, trajs = evaluate(
        InferenceEngine(model, chat),
        rows,
        settings,
        output_dir=tmp_path,
        num_gifs=2,
        show_progress=False,
    )
    assert metrics["eval/all/episodes"] == 3
    assert metrics["eval/all/pass_at_1"] == sum(t.success for t in trajs) / 3
    # 3 turns cannot solve any 7x7 maze from corner to corner.
    assert metrics["eval/all/solvable_ceiling"] == 0.0
    lines = (tmp_path / "trajectories.jsonl").read_text().splitlines()
    assert len(lines) == 3 and len(list((tmp_path / "gifs").glob("*.gif"))) == 2


def test_keep_last_k_images_hides_old_images_the_same_way_in_engine_and_trainer(policy, rows):
    from dataclasses import replace

    from clew.train.worker import PolicyWorker

    model, chat = policy
    settings = replace(_settings(max_turns=4), keep_last_k_images=1)
    trajs = play(InferenceEngine(model, chat), rows, settings, seed=5)
    assert all(
        t.image_window == 1 and len(t.chunk_starts) == t.turns for t in trajs if t.turns == 4
    )
    worker = PolicyWorker(model, chat)
    recomputed = worker.compute_logprobs(trajs, 1.0, 4)
    worst = 0.0
    for t, lp in zip(trajs, recomputed, strict=True):
        mask = torch.tensor(t.loss_mask[1:], dtype=torch.bool)
        worst = max(worst, float((lp[mask] - torch.tensor(t.logprobs[1:])[mask]).abs().max()))
    assert worst < 1e-4, f"largest logprob difference {worst:.2e}"
    # Seeing every image instead gives other logprobs: the old images really were hidden.
    for t in trajs:
        t.image_window = None
    unmasked = worker.compute_logprobs(trajs, 1.0, 4)
    assert max(float((a - b).abs().max()) for a, b in zip(unmasked, recomputed, strict=True)) > 1e-3
    model.eval()


def test_hidden_images_leave_the_kv_cache_without_changing_any_logprob(policy, rows, monkeypatch):
    from dataclasses import replace

    import clew.inference.cache_batch as batch_module
    import clew.inference.engine as engine_module

    model, chat = policy
    settings = replace(_settings(max_turns=6), keep_last_k_images=1)
    widths: list[tuple[int, int]] = []
    compact = engine_module.CacheBatch._compact

    def recording(cached):
        before = cached.cache_tokens
        compact(cached)
        widths.append((before, cached.cache_tokens))

    monkeypatch.setattr(engine_module.CacheBatch, "_compact", recording)
    compacted = play(InferenceEngine(model, chat), rows, settings, seed=7)
    # Some turn dropped columns: the cache holds fewer tokens than were fed.
    assert any(after < before for before, after in widths)
    monkeypatch.setattr(batch_module, "_COMPACT_WHEN_VISIBLE_BELOW", 0.0)
    full = play(InferenceEngine(model, chat), rows, settings, seed=7)
    for a, b in zip(compacted, full, strict=True):
        assert a.token_ids == b.token_ids
        diff = (torch.tensor(a.logprobs) - torch.tensor(b.logprobs)).abs().max()
        assert float(diff) < 1e-5


def test_top_k_and_top_p_keep_only_the_most_likely_tokens():
    from clew.inference.sampling import filter_logits

    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0]])
    assert torch.isfinite(filter_logits(logits, 1, 1.0)).tolist() == [[True, False, False, False]]
    assert torch.isfinite(filter_logits(logits, 3, 1.0)).tolist() == [[True, True, True, False]]
    # softmax = [0.61, 0.22, 0.14, 0.03]: a nucleus of 0.7 needs the first two.
    assert torch.isfinite(filter_logits(logits, -1, 0.7)).tolist() == [[True, True, False, False]]
    assert torch.isfinite(filter_logits(logits, -1, 1.0)).all()


def test_stop_strings_and_max_tokens_end_a_reply(policy, rows):
    model, chat = policy
    engine = InferenceEngine(model, chat)
    env = make(rows[0].env_id, **rows[0].options())
    obs = env.reset(rows[0].seed)
    first = chat.user_turn(obs.text, obs.images, first=True)
    free = engine.open_batch(1, seed=0).extend_and_generate(
        {0: first}, SamplingParams(max_tokens=12)
    )[0]
    assert len(free.token_ids) <= 12
    if free.finish_reason == "length":
        assert len(free.token_ids) == 12
    text = chat.decode(free.token_ids[:3])
    if text.strip():
        stop = text.strip()[-1]
        again = engine.open_batch(1, seed=0).extend_and_generate(
            {0: first}, SamplingParams(max_tokens=12, stop=(stop,))
        )[0]
        assert again.finish_reason == "stop" and len(again.token_ids) <= 3


def test_cached_position_layouts_are_shifted_copies_never_shared_state():
    from clew.models.positions import mrope_positions

    ids = [5, 7, 9, 9, 9, 9, 3]
    grid = torch.tensor([[1, 2, 2]])
    a, nxt_a = mrope_positions(ids, grid, 0, 9, 1)
    b, nxt_b = mrope_positions(ids, grid, 10, 9, 1)
    assert torch.equal(b, a + 10) and nxt_b == nxt_a + 10
    a += 100  # a caller may write into what it got; the next chunk must not see it
    c, _ = mrope_positions(ids, grid, 0, 9, 1)
    assert c.tolist() == [[0, 1, 2, 2, 2, 2, 4], [0, 1, 2, 2, 3, 3, 4], [0, 1, 2, 3, 2, 3, 4]]


@pytest.mark.gpu
def test_sampling_on_the_accelerator_is_seeded_and_matches_the_sampled_logprobs(policy, rows):
    import copy

    model, chat = policy
    a = _assert_seeded(InferenceEngine(copy.deepcopy(model).to("cuda"), chat), rows)
    for t in a:
        assert all(lp <= 0.0 for lp, m in zip(t.logprobs, t.loss_mask, strict=True) if m)


def test_a_forced_reply_format_samples_only_the_word_and_logprobs_still_match(policy, rows):
    from dataclasses import replace

    from clew.train.worker import PolicyWorker

    model, chat = policy
    settings = replace(
        _settings(max_turns=4, max_tokens=1),
        keep_last_k_images=1,
        reply_prefix="<action>",
        reply_suffix="</action>",
    )
    trajs = play(InferenceEngine(model, chat), rows, settings, seed=4)
    prefix, suffix = chat.encode_text("<action>"), chat.encode_text("</action>")
    closed = 0
    for t in trajs:
        sampled = [i for i, m in enumerate(t.loss_mask) if m]
        assert len(sampled) == t.turns  # one sampled token a turn: the format is not sampled
        for turn, i in enumerate(sampled):
            word = t.token_ids[i]
            assert t.token_ids[i - len(prefix) : i] == prefix
            if word == chat.im_end_id:
                assert t.actions[turn] == "<action>"
                continue
            assert t.actions[turn] == f"<action>{chat.decode([word])}</action>"
            if turn + 1 < t.turns:  # the suffix opens the next observation chunk
                assert t.token_ids[i + 1 : i + 1 + len(suffix)] == suffix
                assert t.token_ids[i + 1 + len(suffix)] == chat.im_end_id
                closed += 1
    assert closed > 0
    # The trainer scores the sampled words under exactly the context the engine had.
    recomputed = PolicyWorker(model, chat).compute_logprobs(trajs, 1.0, 4)
    for t, lp in zip(trajs, recomputed, strict=True):
        mask = torch.tensor(t.loss_mask[1:], dtype=torch.bool)
        assert float((lp[mask] - torch.tensor(t.logprobs[1:])[mask]).abs().max()) < 1e-4
    model.eval()


def test_the_forced_format_tokenizes_as_the_whole_reply_does(policy):
    _, chat = policy
    for word in ("up", "down", "left", "right", "stop"):
        pieces = (
            chat.encode_text("<action>") + chat.encode_text(word) + chat.encode_text("</action>")
        )
        assert pieces == chat.encode_text(f"<action>{word}</action>")
    assert chat.encode_text("") == []


def test_pass_at_n_counts_mazes_solved_by_any_sample_and_pass_at_1_every_sample():
    def traj(group: int, sample: int, reward: float) -> Trajectory:
        t = Trajectory("maze_2d/small", {}, 0, group, sample)
        t.reward, t.turns = reward, 1
        return t

    # Three mazes, four samples each: solved by 1, 0 and 4 of them.
    trajs = [traj(0, s, float(s == 2)) for s in range(4)] + [traj(1, s, 0.0) for s in range(4)]
    trajs += [traj(2, s, 1.0) for s in range(4)]
    metrics = eval_metrics(trajs, [], max_turns=8)
    assert metrics["eval/all/pass_at_1"] == pytest.approx(5 / 12)
    assert metrics["eval/all/pass_at_4"] == pytest.approx(2 / 3)
    assert not [
        k
        for k in eval_metrics(trajs[::4], [], 8)
        if k.startswith("eval/all/pass_at_") and k != "eval/all/pass_at_1"
    ]


def test_a_rollout_leaves_no_kv_cache_behind_for_the_update(policy, rows):
    """Colocated workers train right after sampling: the cache must be freed as the rollout
    returns (by reference counting, not whenever the garbage collector runs)."""
    import gc
    import weakref

    from clew.inference import engine as engine_module

    model, chat = policy
    caches: list[weakref.ref] = []
    opened = engine_module.CacheBatch.__init__

    def tracked(self, *args, **kwargs):
        opened(self, *args, **kwargs)
        caches.append(weakref.ref(self))

    gc.disable()
    try:
        engine_module.CacheBatch.__init__ = tracked
        play(InferenceEngine(model, chat), rows[:2], _settings(max_turns=2), seed=0)
        assert caches and all(ref() is None for ref in caches)
    finally:
        engine_module.CacheBatch.__init__ = opened
        gc.enable()


def test_training_reads_the_engines_frames_and_a_pickled_trajectory_encodes_the_same(
    policy, rows, monkeypatch
):
    import pickle

    from clew.models.pixels import Frames
    from clew.train.model_batch import encode_vision

    model, chat = policy
    engine = InferenceEngine(model, chat)
    assert play(engine, rows[:1], _settings(n_samples_per_prompt=1), seed=0)[0].frames == []
    traj = play(engine, rows[:1], _settings(n_samples_per_prompt=1, keep_frames=True), seed=0)[0]
    assert sum(len(f) for f in traj.frames) == len(traj.images) >= 2
    with monkeypatch.context() as m:
        m.setattr(chat, "encode_frames", lambda images: pytest.fail("images encoded again"))
        kept, kept_grid = encode_vision(traj, chat)
    assert isinstance(kept, Frames)
    encoded, grid = chat.encode_frames(list(traj.images))
    assert torch.equal(kept.data, encoded.data) and torch.equal(kept_grid, grid)
    assert torch.equal(kept.patches(), traj.vision_inputs(chat)[0])

    travelled = pickle.loads(pickle.dumps(traj))
    assert travelled.frames == [] and len(travelled.images) == len(traj.images)
    pixels, grid = encode_vision(travelled, chat)
    assert torch.equal(pixels.data, kept.data) and torch.equal(grid, kept_grid)
    # Frames that do not cover every image are not read: the images are encoded.
    traj.frames = traj.frames[:1]
    assert torch.equal(encode_vision(traj, chat)[0].data, kept.data)
