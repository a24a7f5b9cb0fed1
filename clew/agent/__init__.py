"""The agent client: a trained policy plays envs through an OpenAI-compatible endpoint.

``play_episode`` plays one episode with the rollouts' env-side code and the conversation
encoded as the rollouts encode it (``clew.agent.messages``); ``evaluate_endpoint`` plays
an eval set concurrently and reports ``clew.evaluation``'s metrics. ``clew play`` and
``clew eval --endpoint`` are their commands.
"""

from clew.agent.endpoint import Endpoint
from clew.agent.episode import play_episode
from clew.agent.evaluate import evaluate_endpoint
from clew.agent.messages import Conversation, data_url

__all__ = ["Conversation", "Endpoint", "data_url", "evaluate_endpoint", "play_episode"]
