"""Where a maze policy goes wrong: per-turn move quality in closed loop, greedy.

    python experiments/diagnose_policy.py MODEL [ROWS] [DEVICE] [BORDER_PX]

Plays ROWS (default 64) fixed maze_2d/easy eval mazes (14 px cells, 32 turns, current frame
only) and classifies every turn: an optimal move (distance to the goal falls), a wrong move
(rises), a wall bump, stop on/off the goal, or a turn on the goal that is not a stop. Also
counts episodes that revisit a state (loops), what ended each failed episode, and the
episodes solved by the length of the optimal path (moves from the start to the goal). A bump that
repeats the previous turn's bump (same frame, same move) counts as ``wall_repeated``.
BORDER_PX: the env's ``border_px`` (7 for a policy trained with ``gpu_easy.sh BORDER=7``).
"""

import sys
from collections import Counter

from clew.data.rows import generate_rows
from clew.envs import make
from clew.envs.maze.solver import distances_to
from clew.inference.engine import InferenceEngine
from clew.inference.sampling import SamplingParams
from clew.models import load_policy
from clew.models.chat import ChatFormat
from clew.rollout.loop import RolloutSettings, play

model_dir = sys.argv[1]
n = int(sys.argv[2]) if len(sys.argv) > 2 else 64
device = sys.argv[3] if len(sys.argv) > 3 else "cpu"
border_px = int(sys.argv[4]) if len(sys.argv) > 4 else 0
opts = {"cell_px": 14, "border_px": border_px, "max_turns": 32, "action_format": "keyword"}
rows = generate_rows("maze_2d/easy", n, "eval", env_options=opts)
model, processor = load_policy(model_dir, "float32", device)
model.eval()
engine = InferenceEngine(model, ChatFormat(processor))
settings = RolloutSettings(1, 32, 8192, SamplingParams(temperature=0.0, max_tokens=8), 1)
trajs = play(engine, rows, settings, seed=0)
turns: Counter = Counter()
ends: Counter = Counter()
first_error_at: list[int] = []
by_length: dict[str, list[int]] = {}  # optimal path length band -> [solved, episodes]
loops = 0
for traj, row in zip(trajs, rows, strict=True):
    env = make(row.env_id, **row.options())
    env.reset(int(row.seed))
    dist = distances_to(env.maze, env.maze.goal)
    band = f"{dist[env.agent] // 10 * 10:2d}-{dist[env.agent] // 10 * 10 + 9}"
    by_length.setdefault(band, [0, 0])[0] += traj.success
    by_length[band][1] += 1
    seen = {env.agent}
    looped = False
    first = None
    last = None
    for t, action in enumerate(traj.actions):
        before = env.agent
        _, _, done, info = env.step(action)
        ev = info["event"]
        if ev == "moved":
            kind = "optimal" if dist[env.agent] < dist[before] else "wrong"
            if env.agent in seen:
                looped = True
            seen.add(env.agent)
        elif ev == "stop":
            kind = "stop_on_goal" if before == env.maze.goal else "stop_off_goal"
        else:
            kind = ev
        if ev == "wall" and last == ("wall", action):
            kind = "wall_repeated"  # the same bump as the turn before, on the same frame
        last = (ev, action)
        if before == env.maze.goal and ev != "stop":
            kind = "left_goal_" + kind
        turns[kind] += 1
        if first is None and kind not in ("optimal", "stop_on_goal"):
            first = t
        if done:
            break
    ends["solved" if traj.success else f"failed:{traj.end_reason}"] += 1
    loops += looped
    if first is not None:
        first_error_at.append(first)
total = sum(turns.values())
print(f"episodes {len(trajs)}  solved {sum(t.success for t in trajs)}  with a loop {loops}")
print("ends:", dict(ends))
print("turns:", {k: f"{v} ({v / total:.1%})" for k, v in turns.most_common()})
print("first non-optimal turn (sorted):", sorted(first_error_at))
print(
    "solved by optimal path length:",
    {k: f"{s}/{n}" for k, (s, n) in sorted(by_length.items())},
)
