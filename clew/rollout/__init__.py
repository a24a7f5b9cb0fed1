"""Rollouts: a policy plays environments through the engine and leaves trajectories.

What setting up a rollout takes is exported here (``SamplingParams`` included), so code
that plays a policy, such as DAgger's rounds in ``clew.train``, needs nothing from the
engine package.
"""

from clew.inference.sampling import SamplingParams
from clew.rollout.loop import RolloutSettings, play, play_model
from clew.rollout.trajectory import Trajectory

__all__ = ["RolloutSettings", "SamplingParams", "Trajectory", "play", "play_model"]
