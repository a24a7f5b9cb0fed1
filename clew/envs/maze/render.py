"""Pixels of a maze state, to VisGym's specification.

``cell_px`` pixels per cell (25 by default: 225x225 RGB for a 9x9 maze), walls gray
(169, 169, 169), floor white, the goal a full red cell, the agent a blue filled disc of
radius ``cell_px / 4`` (6.25 px at 25 px) at its cell's centre; no grid lines, no text.
The static part of a maze is drawn once per episode and the disc is stamped with a
precomputed mask, so a frame costs one array copy: rendering never limits rollouts.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np
from PIL import Image

from clew.envs.maze.generate import Cell, Maze

WALL_RGB = (169, 169, 169)
FLOOR_RGB = (255, 255, 255)
GOAL_RGB = (255, 0, 0)
AGENT_RGB = (0, 0, 255)


@lru_cache(maxsize=32)
def disc_mask(cell_px: int) -> np.ndarray:
    """Pixels of one cell whose centres lie inside the agent's disc (radius cell_px / 4)."""
    centre = cell_px / 2
    radius = cell_px / 4
    coords = np.arange(cell_px) + 0.5
    dy, dx = np.meshgrid(coords - centre, coords - centre, indexing="ij")
    mask = dx * dx + dy * dy <= radius * radius
    mask.setflags(write=False)
    return mask


def render_background(maze: Maze, cell_px: int) -> np.ndarray:
    """The maze without the agent: walls, floor and goal, as an HxWx3 uint8 array."""
    cells = np.empty((*maze.walls.shape, 3), dtype=np.uint8)
    cells[:] = FLOOR_RGB
    cells[maze.walls] = WALL_RGB
    cells[maze.goal] = GOAL_RGB
    return np.repeat(np.repeat(cells, cell_px, axis=0), cell_px, axis=1)


def stamp_agent(background: np.ndarray, agent: Cell, cell_px: int) -> np.ndarray:
    """A copy of ``background`` with the agent's disc drawn in cell ``agent``."""
    frame = background.copy()
    r, c = agent
    block = frame[r * cell_px : (r + 1) * cell_px, c * cell_px : (c + 1) * cell_px]
    block[disc_mask(cell_px)] = AGENT_RGB
    return frame


def render_state(maze: Maze, agent: Cell, cell_px: int = 25) -> Image.Image:
    """The RGB image of ``maze`` with the agent at ``agent``."""
    return Image.fromarray(stamp_agent(render_background(maze, cell_px), agent, cell_px))
