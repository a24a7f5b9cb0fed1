"""Fixtures of the training-path tests."""

from __future__ import annotations

import pytest

from clew.data.rows import generate_rows
from clew.train.model_batch import Sample
from clew.trainer.demonstrations import demonstrations

OPTIONS = {"cell_px": 28, "action_format": "keyword", "max_turns": 12}


@pytest.fixture(scope="module")
def seqs(chat) -> list:
    """Maze episodes of mixed lengths with images, some hiding all but their latest frame
    (so packed sequences bring their own visibility masks), and one text-only sequence."""
    rows = generate_rows("maze_2d/tiny", 8, env_options=OPTIONS)
    demos = sorted(
        demonstrations(rows, chat, detour_prob=0.4, seed=3, start_anywhere=1.0),
        key=lambda d: len(d.token_ids),
    )
    out = demos[:2] + demos[-2:]
    for d in out[::2]:
        d.image_window = 1
    ids = chat.encode_text("go left then up and then right again")
    out.insert(2, Sample(ids, [0] * (len(ids) - 3) + [1] * 3))
    return out
