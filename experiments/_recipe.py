"""What the GPU recipe's rollouts look like, shared by the rollout experiments.

``experiments/gpu_easy.sh`` plays maze_2d/easy with 14 px cells, 32 turns, keyword actions,
the current frame only, up to 8 tokens a reply; the experiments that time or compare
rollouts take the same rows and settings from here, and their first command-line words.
"""

from __future__ import annotations

import os
import sys

from clew.data.rows import MazeRow, generate_rows
from clew.inference.sampling import SamplingParams
from clew.rollout.loop import RolloutSettings

OPTIONS = {"cell_px": 14, "max_turns": 32, "action_format": "keyword"}


def args(prompts: int, samples: int) -> tuple[str, str, int, int]:
    """``MODEL_DIR [DEVICE] [PROMPTS] [SAMPLES]`` from argv, with these defaults."""
    argv = sys.argv
    return (
        argv[1],
        argv[2] if len(argv) > 2 else "cpu",
        int(argv[3]) if len(argv) > 3 else prompts,
        int(argv[4]) if len(argv) > 4 else samples,
    )


def rows(prompts: int) -> list[MazeRow]:
    return generate_rows("maze_2d/easy", prompts, "train", env_options=OPTIONS)


def settings(samples: int) -> RolloutSettings:
    """The recipe's rollout settings; ``FORCED=1`` in the environment: the forced reply format
    (``FORCED=1`` of gpu_easy.sh), ``TEMPERATURE`` (default 0.7) the sampling temperature."""
    forced = os.environ.get("FORCED") == "1"
    temperature = float(os.environ.get("TEMPERATURE", "0.7"))
    sampling = SamplingParams(temperature=temperature, max_tokens=1 if forced else 8)
    framing = ("<action>", "</action>") if forced else ("", "")
    return RolloutSettings(samples, 32, 8192, sampling, 1, *framing)
