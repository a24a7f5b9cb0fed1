"""Pictures of episodes: an animated GIF and a contact sheet, so people can see what an
agent did. An episode is replayed from its env id, options, seed and action texts, which
is all a recorded trajectory needs to store."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from PIL import Image, ImageDraw

from clew.envs.base import make
from clew.errors import DataError


@dataclass
class Replay:
    frames: list[Image.Image]
    captions: list[str]
    reward: float


def replay(
    env_id: str, seed: int, actions: list[str], env_options: dict[str, Any] | None = None
) -> Replay:
    """Play ``actions`` (reply texts) from the maze of ``seed``; stops early when the episode ends."""
    env = make(env_id, **(env_options or {}))
    obs = env.reset(seed)
    frames, captions, reward = [obs.images[-1]], ["start"], 0.0
    for turn, action in enumerate(actions, start=1):
        obs, reward, done, info = env.step(action)
        # An env may end on an observation without an image (the protocol allows it): the
        # last picture stands for that turn. Envs without a note are captioned by the reply.
        frames.append(obs.images[-1] if obs.images else frames[-1])
        captions.append(f"{turn}: {str(info.get('note', action)).split(';')[0][:40]}")
        if done:
            break
    return Replay(frames, captions, reward)


def write_gif(frames: list[Image.Image], path: str | Path, ms_per_frame: int = 400) -> Path:
    path = _writable(path)
    first, *rest = [f.convert("P", palette=Image.Palette.ADAPTIVE) for f in frames]
    # The last frame lingers so the ending is readable.
    durations = [ms_per_frame] * (len(frames) - 1) + [ms_per_frame * 4]
    first.save(path, save_all=True, append_images=rest, duration=durations, loop=0)
    return path


def contact_sheet(frames: list[Image.Image], captions: list[str], columns: int = 6) -> Image.Image:
    """Frames in a grid, each with its caption underneath."""
    w, h = frames[0].size
    caption_h = 14
    cols = min(columns, len(frames))
    rows = math.ceil(len(frames) / cols)
    sheet = Image.new("RGB", (cols * (w + 4) + 4, rows * (h + caption_h + 4) + 4), "white")
    draw = ImageDraw.Draw(sheet)
    for i, (frame, caption) in enumerate(zip(frames, captions, strict=True)):
        x = 4 + (i % cols) * (w + 4)
        y = 4 + (i // cols) * (h + caption_h + 4)
        sheet.paste(frame, (x, y))
        draw.text((x + 2, y + h + 1), caption, fill="black")
    return sheet


def write_episode(replayed: Replay, stem: str | Path) -> tuple[Path, Path]:
    """Write ``stem.gif`` and ``stem.png`` (the contact sheet) for one replayed episode."""
    stem = Path(stem)
    gif = write_gif(replayed.frames, stem.with_suffix(".gif"))
    png = _writable(stem.with_suffix(".png"))
    contact_sheet(replayed.frames, replayed.captions).save(png)
    return gif, png


def _writable(path: str | Path) -> Path:
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise DataError(f"cannot create the folder {path.parent}: {exc.strerror or exc}") from None
    if not path.parent.is_dir() or not _can_write(path.parent):
        raise DataError(f"the folder {path.parent} is not writable")
    return path


def _can_write(folder: Path) -> bool:
    import os

    return os.access(folder, os.W_OK)
