"""Replays of envs whose episode ends on an observation without an image."""

from __future__ import annotations

import envs_for_tests  # noqa: F401  (registers test/digits)

from clew.envs.media import replay, write_episode


def test_replay_keeps_the_last_picture_when_the_final_observation_has_none(tmp_path):
    played = replay("test/digits", 7, ["123 go"])
    assert len(played.frames) == 2 and played.frames[1] is played.frames[0]
    assert played.captions == ["start", "1: 123 go"]
    assert played.reward > 0
    write_episode(played, tmp_path / "episode")
    assert sorted(p.suffix for p in tmp_path.iterdir()) == [".gif", ".png"]
