"""Record VisGym's and SkyRL's own maze conversations, for clew's prompt-format tests.

Runs VisGym's evaluation loop (``gymnasium/vlm/interactor.py`` ``Interactor.run_episode``
with ``include_env_feedback=True``, as ``inference/run_experiments.sh`` runs it) and SkyRL's
VisGym env (``examples/train/visgym/env_sft.py``) on ``maze_2d/easy`` with scripted
replies, and writes every text the model would see, where the agent stood after each reply
and SkyRL's rewards to ``visgym_conversations.json`` beside this file.
``tests/envs/test_prompt_formats.py`` plays the same replies through clew's ``visgym`` and
``skyrl-visgym`` formats and compares.

Needs a VisGym checkout (its gymnasium fork; pygame, numpy, pillow, ipywidgets and
IPython installed) and a SkyRL checkout's ``examples/train/visgym`` with
``skyrl_gym.envs.base_text_env`` importable; VisGym's ``gymnasium/vlm/vlm.py`` (which
imports torch and model clients) is replaced by a stand-in ``BaseVLM`` that answers with
the scripted replies::

    python tests/recorded/make_visgym_conversations.py --visgym VISGYM_DIR --skyrl SKYRL_DIR \
        --visgym-commit SHA --skyrl-commit SHA
"""

from __future__ import annotations

import argparse
import json
import sys
import types
from pathlib import Path

SEEDS = (0, 1, 2, 7)
REPLIES = (
    "('move', 0)",
    "<observation>The agent is top left.</observation><justification>Down is open."
    "</justification><action>('move', 3)</action>",
    "I will go ('move', 1), no: ('move', 2)",
    "```python\n('move', 3)\n```",
    "(move, 1)",
    '{"action": "move", "args": 2}',
    "Action: ('move', 0)",
    "('move', 7)",
    "('jump', 1)",
    "('move', '1')",
    "move right",
    "",
    "('move', 3)",
    "('move', 0)",
    "('stop', 'stop')",
)


def _stub_vlm_module() -> None:
    module = types.ModuleType("gymnasium.vlm.vlm")

    class BaseVLM:
        def __init__(self) -> None:
            self.conversation_history: list = []

        def reset_conversation(self) -> None:
            self.conversation_history = []

    module.BaseVLM = BaseVLM  # type: ignore[attr-defined]
    sys.modules["gymnasium.vlm.vlm"] = module


def visgym_episode(seed: int, replies: tuple[str, ...]) -> dict:
    import gymnasium
    from gymnasium.vlm.interactor import Interactor
    from gymnasium.vlm.vlm import BaseVLM

    prompts: list[str] = []
    agents: list[list[int]] = []
    env = gymnasium.make("maze_2d/easy")

    class Scripted(BaseVLM):
        def query(self, image_base64: str, prompt: str, **_: object) -> str:
            if prompts:  # the reply before this prompt has been executed
                agents.append([int(x) for x in env.unwrapped._agent_location])
            prompts.append(prompt)
            return replies[len(prompts) - 1]

    interactor = Interactor(Scripted(), env, max_steps=20, master_seed=None)
    stats = interactor.run_episode(seed=seed, include_env_feedback=True)
    agents.append([int(x) for x in env.unwrapped._agent_location])
    return {"prompts": prompts, "agents": agents, "reward": float(stats["reward"])}


def skyrl_episode(seed: int, replies: tuple[str, ...], max_turns: int) -> dict:
    from examples.train.visgym.env_sft import VisGymEnv

    env = VisGymEnv(extras={"visgym_env_id": "maze_2d/easy", "seed": seed, "max_turns": max_turns})
    first, _ = env.init([])
    texts = [first[0]["content"][0]["text"]]
    order = [c["type"] for c in first[0]["content"]]
    agents, rewards = [], []
    for reply in replies:
        out = env.step(reply)
        agents.append([int(x) for x in env.visgym_env.unwrapped._agent_location])
        rewards.append(float(out["reward"]))
        if out["done"]:
            break
        texts.append(out["observations"][0]["content"][0]["text"])
    return {"texts": texts, "content_order": order, "agents": agents, "rewards": rewards}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--visgym", required=True, help="a VisGym checkout")
    p.add_argument("--skyrl", required=True, help="a SkyRL checkout")
    p.add_argument("--visgym-commit", required=True)
    p.add_argument("--skyrl-commit", required=True)
    p.add_argument("--output", default=str(Path(__file__).with_name("visgym_conversations.json")))
    args = p.parse_args()
    sys.path[:0] = [args.visgym, args.skyrl]
    _stub_vlm_module()
    episodes = []
    for seed in SEEDS:
        replies = REPLIES if seed != 7 else REPLIES[:1] + ("('stop', 'stop')",)
        episodes.append(
            {
                "seed": seed,
                "replies": list(replies),
                "visgym": visgym_episode(seed, replies),
                "skyrl": skyrl_episode(seed, replies, max_turns=12 if seed == 2 else 15),
                "skyrl_max_turns": 12 if seed == 2 else 15,
            }
        )
    record = {
        "made_by": "tests/recorded/make_visgym_conversations.py",
        "visgym": {"repository": "visgym/VisGym", "commit": args.visgym_commit},
        "skyrl": {"repository": "NovaSky-AI/SkyRL", "commit": args.skyrl_commit},
        "env_id": "maze_2d/easy",
        "episodes": episodes,
    }
    Path(args.output).write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {args.output}: {len(episodes)} episodes")


if __name__ == "__main__":
    main()
