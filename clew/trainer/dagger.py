"""DAgger for SFT: the policy plays, the env's expert labels the states where it went wrong.

Works for any env registered with an expert (``clew.envs.Expert``). Expert demonstrations
only show states on (or one detour off) the expert's path. A state the policy reaches by
its own misreading is never in them: in a maze, after it bumps a wall the frame is
unchanged and only the env's reply ("hit a wall moving right; you did not move") says what
happened, and SFT policies repeat most of their bumps (docs/learning-easy.md, "DAgger
beats plain SFT"). DAgger (Ross et al., 2011) trains on the states the policy itself
visits, labelled by the expert.

Each round plays the current policy on training rows (``clew.rollout.loop.play_model``, the engine
the evaluations use) and turns every episode that went wrong into one *branch
demonstration*: the policy's own turns up to one of its mistakes (a turn that left the
expert no fewer turns to finish: in a maze a move that did not bring it closer to the goal,
a wall bump, an unreadable reply) are the context, out of the loss, and from that very
state the expert plays to the end, in the loss. The first expert turn is the label on the
state the policy got wrong, with the history it got there by.
The branch demonstrations of the latest ``keep_rounds`` rounds (all of them with 0: the
dataset aggregation of DAgger proper) fill a share of every SFT batch until the next round.
The default keeps the latest round only: a demonstration holds its frames as images, 1-2 MB
(an expert demonstration of an easy maze in 140 px frames: 1.2 MB on average), and a round
gives one per episode that went wrong, so a pool of every round grows by a few hundred MB a
round at the GPU recipe's 384 rows. The policy plays the rows as they are: from their own
starts, or from anywhere where the rows carry the env's ``start_anywhere`` option (``clew
dataset --option``); SFT's own ``start_anywhere`` moves only the expert's demonstrations. No
library does this for multi-turn VLM SFT (TRL's SFTTrainer trains on a fixed dataset;
imitation libraries such as ``imitation`` drive gym policies, not chat models), so it is
written here on clew's own rollout loop and demonstration player.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from clew.data.rows import Row
from clew.envs import expert_for, make
from clew.errors import ConfigError
from clew.models.chat import ChatFormat
from clew.trainer.demonstrations import Demonstration, play_demonstration

if TYPE_CHECKING:
    from clew.rollout import RolloutSettings
    from clew.rollout.trajectory import Trajectory


@dataclass(frozen=True)
class DaggerSettings:
    """When and how much the policy plays for DAgger during SFT."""

    interval: int  # SFT steps between rounds (the first round after `interval` steps)
    rows: int = 64  # training rows the policy plays each round
    share: float = 0.5  # share of each SFT batch taken from the pool of branch demonstrations
    keep_rounds: int = 1  # rounds whose demonstrations the pool keeps, newest first (0: all)
    temperature: float = 1.0  # the policy's sampling temperature in those episodes
    max_generate_length: int = 16  # tokens a reply may take (as the SFT evaluation's)

    def __post_init__(self) -> None:
        if self.interval < 1:
            raise ConfigError(f"dagger interval is a number of SFT steps >= 1, got {self.interval}")
        if self.rows < 1:
            raise ConfigError(f"dagger rows must be >= 1, got {self.rows}")
        if not 0.0 < self.share <= 1.0:
            raise ConfigError(f"dagger share is a share of each batch in (0, 1], got {self.share}")
        if self.keep_rounds < 0:
            raise ConfigError(
                f"dagger keep_rounds is a number of rounds >= 0 (0: every round), got {self.keep_rounds}"
            )
        if self.temperature < 0:
            raise ConfigError(
                f"dagger temperature must be >= 0 (0: greedy), got {self.temperature}"
            )


def branch_points(row: Row, actions: Sequence[str]) -> list[int]:
    """The turns of an episode of ``row`` where the played action was not optimal.

    A turn is optimal when it earns the success reward or leaves the expert fewer turns to
    finish than before it (``Expert.turns_to_finish``). Only turns from which the expert
    can still finish within the turn budget count: a branch there must succeed.
    """
    expert = expert_for(row.env_id)
    env = make(row.env_id, **row.options())
    env.reset(int(row.seed))
    out = []
    for turn, action in enumerate(actions):
        before = expert.turns_to_finish(env)
        _, reward, done, _ = env.step(action)
        after = expert.turns_to_finish(env)
        progressed = before is not None and after is not None and after < before
        optimal = progressed or (done and reward > 0)
        if not optimal and before is not None and env.max_turns - turn >= before:
            out.append(turn)
        if done:
            break
    return out


def branch_demonstrations(
    rows: Sequence[Row],
    played: Sequence[Sequence[str]],
    chat: ChatFormat,
    rng: random.Random,
) -> list[Demonstration]:
    """One branch demonstration per episode that went wrong, at one of its mistakes.

    ``played[i]`` holds the replies of an episode of ``rows[i]``. The mistake is drawn
    uniformly, so a policy that bumps the same wall five times is also labelled after its
    second, third, ... bump, where the env's replies are in the context.
    """
    out = []
    for row, actions in zip(rows, played, strict=True):
        points = branch_points(row, actions)
        if not points:
            continue
        k = rng.choice(points)
        demo = play_demonstration(row, chat, rng, prefix=list(actions[:k]))
        if demo is not None and demo.reward > 0:
            out.append(demo)
    return out


PlayFn = Callable[[Sequence[Row], "RolloutSettings", int], "list[Trajectory]"]
"""``play(rows, settings, seed)``: the current policy's episodes of ``rows``, one each."""


def dagger_round(
    play: PlayFn,
    chat: ChatFormat,
    rows: Sequence[Row],
    settings: DaggerSettings,
    rng: random.Random,
    *,
    image_window: int | None = None,
) -> tuple[list[Demonstration], dict[str, float]]:
    """The current policy (``play``) plays ``settings.rows`` of ``rows``; its branch
    demonstrations. ``rng`` picks the rows, the episodes' seed and the branches here, so a
    policy that plays in another process leaves this generator where a local one would."""
    from clew.rollout import RolloutSettings, SamplingParams

    begun = time.monotonic()
    picked = rng.sample(list(rows), min(settings.rows, len(rows)))
    rollout = RolloutSettings(
        1,
        max(r.max_turns for r in picked),
        8192,
        SamplingParams(temperature=settings.temperature, max_tokens=settings.max_generate_length),
        keep_last_k_images=image_window,
    )
    trajs = play(picked, rollout, rng.randrange(2**31))
    demos = branch_demonstrations(picked, [t.actions for t in trajs], chat, rng)
    for demo in demos:
        demo.image_window = image_window
    stats = {
        "sft/dagger_solve_rate": sum(t.success for t in trajs) / len(trajs),
        "sft/dagger_demonstrations": float(len(demos)),
        "sft/dagger_s": time.monotonic() - begun,
    }
    return demos, stats


def mix_in(
    batch: list[Demonstration], pool: Sequence[Demonstration], share: float, rng: random.Random
) -> list[Demonstration]:
    """``batch`` with its last ``share`` of places taken by demonstrations drawn from ``pool``."""
    if not pool:
        return batch
    n = min(len(batch), max(1, round(share * len(batch))))
    return batch[: len(batch) - n] + [rng.choice(pool) for _ in range(n)]
