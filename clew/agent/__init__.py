"""The agent client: a trained policy plays envs through an OpenAI-compatible endpoint.

``play_episode`` plays one episode with the rollouts' env-side code and the conversation
encoded as the rollouts encode it (``clew.agent.messages``); ``evaluate_endpoint`` plays
an eval set concurrently and reports ``clew.rollout.evaluation``'s metrics. ``clew play`` and
``clew eval --endpoint`` are their commands. ``EpisodeTurns`` is the same episode driven one
request at a time by whoever sends it (the playground page of ``clew serve``), and
``chat_body`` the request body ``Endpoint`` sends.
"""

from clew.agent.endpoint import Endpoint, Reply, chat_body
from clew.agent.episode import EpisodeTurns, TurnRequest, play_episode
from clew.agent.evaluate import evaluate_endpoint
from clew.agent.messages import Conversation, data_url

__all__ = [
    "Conversation",
    "Endpoint",
    "EpisodeTurns",
    "Reply",
    "TurnRequest",
    "chat_body",
    "data_url",
    "evaluate_endpoint",
    "play_episode",
]
