"""Tests for clew.trainer.demonstrations: solver episodes, detours, batches, image windows."""

from __future__ import annotations

import random

import pytest
import torch

from clew.data.rows import generate_rows
from clew.envs import make
from clew.envs.maze.actions import Action, format_action, parse_action
from clew.envs.maze.solver import shortest_actions
from clew.errors import ConfigError, EnvError
from clew.train.model_batch import collate
from clew.trainer.demonstrations import demonstrations, play_demonstration

OPTIONS = {"cell_px": 28, "action_format": "keyword"}


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def rows():
    return generate_rows("maze_2d/tiny", 12, env_options=OPTIONS)


def reply_runs(token_ids: list[int], loss_mask: list[int]) -> list[list[int]]:
    """The maximal runs of loss-mask tokens."""
    runs, current = [], []
    for token, m in zip(token_ids, loss_mask, strict=True):
        if m:
            current.append(token)
        elif current:
            runs.append(current)
            current = []
    return runs + ([current] if current else [])


def test_demonstrations_train_only_on_replies_that_replay_the_solver(chat, rows):
    demos = demonstrations(rows, chat)
    assert len(demos) == len(rows)
    for row, demo in zip(rows, demos, strict=True):
        env = make(row.env_id, **row.options())
        env.reset(row.seed)
        solver = [Action("move", d) for d in shortest_actions(env.maze)] + [Action("stop")]
        runs = reply_runs(demo.token_ids, demo.loss_mask)
        assert [parse_action(chat.decode(r), "keyword") for r in runs] == solver
        assert all(r[-1] == chat.im_end_id for r in runs)
        assert demo.actions == [format_action(a, "keyword") for a in solver]
        assert demo.reward == 1.0 and demo.detour_turns == []
        assert len(demo.images) == len(solver)
        # Exactly what the rollout engine would build: user turn, reply, user turn, ...
        expected: list[int] = []
        obs = env.reset(row.seed)
        for turn, action in enumerate(demo.actions):
            expected += chat.user_turn(obs.text, obs.images, first=turn == 0).token_ids
            expected += chat.reply_tokens(action)
            obs, *_ = env.step(action)
        assert demo.token_ids == expected
        assert sum(demo.loss_mask) == sum(len(r) for r in runs)


def test_detours_stay_within_max_turns_and_still_end_on_the_goal(chat, rows):
    detours = 0
    for seed in range(3):
        for demo in demonstrations(rows, chat, detour_prob=0.5, seed=seed):
            assert len(demo.actions) <= rows[0].max_turns
            assert demo.reward == 1.0
            assert parse_action(demo.actions[-1], "keyword") == Action("stop")
            runs = reply_runs(demo.token_ids, demo.loss_mask)
            assert len(runs) == len(demo.actions) - len(demo.detour_turns)
            detours += len(demo.detour_turns)
    assert detours > 20


def test_demonstrations_from_anywhere_start_on_other_open_cells_and_still_solve(chat, rows):
    def moved(demos) -> int:
        count = 0
        for demo in demos:
            row = next(r for r in rows if r.seed == demo.row_seed)
            start = make(row.env_id, **row.options()).reset(row.seed).images[0]
            assert demo.reward == 1.0 and len(demo.actions) <= row.max_turns
            count += demo.images[0].tobytes() != start.tobytes()
        return count

    assert moved(demonstrations(rows, chat, start_anywhere=1.0)) >= len(rows) // 2
    assert moved(demonstrations(rows, chat, detour_prob=0.5)) == 0  # the maze's own start
    with pytest.raises(ConfigError, match=r"start_anywhere is a share in \[0, 1\], got 1.5"):
        demonstrations(rows, chat, start_anywhere=1.5)
    with pytest.raises(EnvError, match="is not an open cell"):
        make(rows[0].env_id, **rows[0].options()).reset(rows[0].seed, start=(0, 0))


def test_detour_replies_enter_the_loss_only_when_asked(chat, rows):
    row = rows[0]
    masked = play_demonstration(row, chat, random.Random(0), detour_prob=1.0)
    trained = play_demonstration(
        row, chat, random.Random(0), detour_prob=1.0, train_on_detours=True
    )
    assert masked is not None and trained is not None and masked.detour_turns
    assert masked.token_ids == trained.token_ids
    assert len(reply_runs(trained.token_ids, trained.loss_mask)) == len(trained.actions)


def test_demonstrations_record_where_each_observation_starts(chat, rows):
    demo = play_demonstration(rows[0], chat, random.Random(0))
    assert len(demo.chunk_starts) == len(demo.actions) == len(demo.images)
    assert demo.chunk_starts[0] == 0
    # Each later observation starts right after a reply's <|im_end|>.
    assert all(demo.token_ids[s - 1] == chat.im_end_id for s in demo.chunk_starts[1:])


def _reference_visibility(token_ids, chunk_starts, image_token_id, keep_last_k):
    """The mask by its definition, token pair by token pair (slow, for small sequences)."""
    n = len(token_ids)
    image_of = [-1] * n
    image_chunk = []  # the chunk each image was fed with
    for i, t in enumerate(token_ids):
        if t == image_token_id and (i == 0 or token_ids[i - 1] != image_token_id):
            image_chunk.append(sum(s <= i for s in chunk_starts) - 1)
        if t == image_token_id:
            image_of[i] = len(image_chunk) - 1
    out = torch.zeros(n, n, dtype=torch.bool)
    for q in range(n):
        # A reply's last token is fed with the next chunk: it belongs to that chunk's epoch.
        epoch = sum(s <= q + 1 for s in chunk_starts) - 1
        seen_images = sum(c <= epoch for c in image_chunk)
        for k in range(q + 1):
            out[q, k] = image_of[k] < 0 or image_of[k] >= seen_images - keep_last_k
    return out


def test_batched_visibility_equals_the_definition_with_padding_and_mixed_windows(chat, rows):
    demos = demonstrations(rows[:3], chat)
    demos[0].image_window, demos[1].image_window, demos[2].image_window = 1, None, 2
    batch = collate(demos, chat)
    vis = batch.visibility
    width = max(batch.lengths)
    assert vis.shape == (3, 1, width, width)
    for row, demo in enumerate(demos):
        n = len(demo.token_ids)
        k = demo.image_window
        expected = (
            _reference_visibility(demo.token_ids, demo.chunk_starts, chat.image_token_id, k)
            if k
            else torch.ones(n, n, dtype=torch.bool).tril()
        )
        assert torch.equal(vis[row, 0, :n, :n], expected)
        assert not vis[row, 0, :n, n:].any()  # nobody sees padding
        assert vis[row, 0, n:, :n].all() and not vis[row, 0, n:, n:].any()
    # The model gets the same mask as an additive float mask.
    mask = batch.model_inputs("cpu")["attention_mask"]
    assert torch.equal(mask == 0, vis)
