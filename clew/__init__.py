"""clew: train vision-language agents with multi-turn RL, and serve what you train."""

__version__ = "0.1.0"
