"""Pixels of a maze state, to VisGym's specification.

``cell_px`` pixels per cell (25 by default: 225x225 RGB for a 9x9 maze), walls gray
(169, 169, 169), floor white, the goal a full red cell, the agent a blue filled disc of
radius ``cell_px / 4`` (6.25 px at 25 px) at its cell's centre; no grid lines, no text.
The static part of a maze is drawn once per episode and the disc is stamped with a
precomputed mask, so a frame costs one array copy: rendering never limits rollouts.

``border_px`` (0 by default, VisGym's frame) draws a wall-gray border that wide around the
maze. Half a cell (7 px at 14 px cells) matters for a policy trained from scratch whose
vision patch is one cell: without it the patch grid runs along the cells' edges, so no
patch holds any part of the agent's neighbours and the vision tower must learn attention to
fixed offsets before the policy can see a wall next to it, which small towers trained from
scratch do not learn in thousands of steps (docs/learning-easy.md, "The policy must see its
walls"). Shifted by half a cell, the
four patches around the agent's centre each hold a quarter of the agent and of two of its
neighbours, and a linear probe reads the open move off them at once.
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


def render_background(maze: Maze, cell_px: int, border_px: int = 0) -> np.ndarray:
    """The maze without the agent: walls, floor and goal, as an HxWx3 uint8 array."""
    cells = np.empty((*maze.walls.shape, 3), dtype=np.uint8)
    cells[:] = FLOOR_RGB
    cells[maze.walls] = WALL_RGB
    cells[maze.goal] = GOAL_RGB
    image = np.repeat(np.repeat(cells, cell_px, axis=0), cell_px, axis=1)
    if border_px:
        b = border_px
        image = np.pad(image, ((b, b), (b, b), (0, 0)))
        image[:b], image[-b:], image[:, :b], image[:, -b:] = WALL_RGB, WALL_RGB, WALL_RGB, WALL_RGB
    return image


def stamp_agent(
    background: np.ndarray, agent: Cell, cell_px: int, border_px: int = 0
) -> np.ndarray:
    """A copy of ``background`` with the agent's disc drawn in cell ``agent``."""
    frame = background.copy()
    top, left = border_px + agent[0] * cell_px, border_px + agent[1] * cell_px
    block = frame[top : top + cell_px, left : left + cell_px]
    block[disc_mask(cell_px)] = AGENT_RGB
    return frame


def render_state(maze: Maze, agent: Cell, cell_px: int = 25, border_px: int = 0) -> Image.Image:
    """The RGB image of ``maze`` with the agent at ``agent``."""
    background = render_background(maze, cell_px, border_px)
    return Image.fromarray(stamp_agent(background, agent, cell_px, border_px))
