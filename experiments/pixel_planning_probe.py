"""The planning probe through pixels: does the policy's architecture plan from its frames?

    python experiments/pixel_planning_probe.py STEPS DEVICE THETA [THETA ...]
    WIDTH=128 HEADS=2 LAYERS=6 BATCH=32 BORDER=7 python experiments/pixel_planning_probe.py 1500 cpu 5e6 100
    WIDTH=256 HEADS=4 BATCH=256 WORKERS=6 python experiments/pixel_planning_probe.py 3000 cuda 5e6

``planning_probe.py`` showed a Qwen3 text model of the policy's size naming the solver's
move from 81 cell tokens at 98.5% of junctions (6 layers, width 256, 3,600 GPU steps), while
the pixel policy agrees with the solver at 60-70% there after SFT and GRPO. This is the same
question asked of the policy's own architecture (``clew init-model --arch qwen3_vl``, the
`small` vision tower, 14 px patches over 14 px cells, merge 1, BORDER px of wall gray): the
input is the rendered frame alone (``<|vision_start|>`` image tokens ``<|vision_end|>`` and
one query token), the readout a linear head on the query's last hidden state, the data the
same (any open cell of 20,000 train mazes; every open cell of the 64 eval mazes).

THETA is the language model's ``rope_theta``; each value trains one model from the same
seed. The policy's is 5e6 (Qwen3-VL's): with interleaved M-RoPE and head_dim 64 the
image's row and column axes get 10 rotary frequencies each, of which only two or three turn
by more than 0.1 rad a cell, so attending to "the cell beside me" is blurred over the grid;
the text probe had 1-D RoPE with theta 1e4 and every frequency. MEAN, STD (one value for
the three channels) and POSITION_TABLE are ``clew init-model``'s ``--image-mean``,
``--image-std``, ``--position-table``. WIDTH (128) and HEADS (2)
give head_dim 64 as in the policy; LAYERS (6) as in the `small` preset.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time

import numpy as np
import torch
from PIL import Image
from planning_probe import SIZE, optimizer_step, probe_mazes

from clew.envs.maze.generate import DIRECTIONS, Maze
from clew.envs.maze.render import render_background, stamp_agent
from clew.envs.maze.solver import distances_to, next_move
from clew.models import build_model, load_policy
from clew.models.chat import ChatFormat

CELL = 14


def states(mazes: list[Maze]) -> list[tuple[int, tuple[int, int], int, bool]]:
    """(maze index, agent cell, solver move, junction) for every open cell but the goal."""
    out = []
    for m, maze in enumerate(mazes):
        dist = distances_to(maze, maze.goal)
        for r, c in zip(*np.nonzero(dist > 0), strict=True):
            exits = sum(maze.is_open((r + dr, c + dc)) for dr, dc in DIRECTIONS)
            out.append((m, (int(r), int(c)), next_move(maze, dist, (r, c)), exits >= 3))
    return out


class Frames:
    """Renders (maze, agent) states into the model's inputs (on the host), one batch at a time."""

    def __init__(self, chat: ChatFormat, mazes: list[Maze], border: int) -> None:
        self.chat, self.border = chat, border
        self.backgrounds = [render_background(m, CELL, border) for m in mazes]
        side = SIZE * CELL + 2 * border
        n = (side // CELL) ** 2
        query = chat.encode_text("move")[-1:]
        self.ids = [chat.vision_start_id, *[chat.image_token_id] * n, chat.vision_end_id, *query]

    def batch(self, picked: list[tuple[int, tuple[int, int], int, bool]]) -> dict:
        images = [
            Image.fromarray(stamp_agent(self.backgrounds[m], cell, CELL, self.border))
            for m, cell, _, _ in picked
        ]
        pixel_values, grid = self.chat.encode_images(images)
        ids = torch.tensor([self.ids] * len(picked))
        return {
            "input_ids": ids,
            "attention_mask": torch.ones_like(ids),
            "pixel_values": pixel_values,
            "image_grid_thw": grid,
            "mm_token_type_ids": (ids == self.chat.image_token_id).int(),
            "labels": torch.tensor([s[2] for s in picked]),
        }


class TrainBatches(torch.utils.data.IterableDataset):
    """Random training batches, rendered in DataLoader workers (WORKERS, default 0: in the
    loop): one batch of 256 frames took about 0.1 s on a core of the 2-core dev machine,
    longer than the symbolic probe's whole GPU step (0.04 s), so the GPU would wait on it."""

    def __init__(self, frames: Frames, train: list, batch: int, steps: int) -> None:
        self.frames, self.train, self.batch, self.steps = frames, train, batch, steps

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        worker, workers = (info.id, info.num_workers) if info else (0, 1)
        rng = np.random.default_rng(worker)
        for _ in range(worker, self.steps, workers):
            yield self.frames.batch(
                [self.train[i] for i in rng.integers(len(self.train), size=self.batch)]
            )


def to_device(inputs: dict, device: str) -> dict:
    return {k: v.to(device, non_blocking=True) for k, v in inputs.items() if k != "labels"}


def hidden(model, inputs: dict) -> torch.Tensor:
    cuda = inputs["input_ids"].device.type == "cuda"
    with torch.autocast("cuda", torch.bfloat16, enabled=cuda):
        return model.model(**inputs).last_hidden_state[:, -1].float()


def input_dependence(model, frames: Frames, picked: list, device: str) -> tuple[float, float]:
    """How much the frame moves the model's states: across ``picked`` states, the spread of
    the image embeddings at each position over their overall spread, and the spread of the
    query's last hidden state over its mean size (0 for a model that ignores the frame)."""
    inputs = to_device(frames.batch(picked), device)
    seen: dict[str, torch.Tensor] = {}

    def keep(module, args, kwargs, out) -> None:
        seen["embeds"] = kwargs["inputs_embeds"]

    handle = model.model.language_model.register_forward_hook(keep, with_kwargs=True)
    with torch.no_grad():
        h = hidden(model, inputs)
    handle.remove()
    image = seen["embeds"][:, 1:-2].float()
    return float(image.std(0).mean() / image.std()), float(h.std(0).mean() / h.abs().mean())


def accuracy(model, head, frames: Frames, ev: list, device: str) -> tuple[float, float]:
    model.eval()
    right = []
    with torch.no_grad():
        for i in range(0, len(ev), 64):
            chunk = ev[i : i + 64]
            pred = head(hidden(model, to_device(frames.batch(chunk), device))).argmax(-1).cpu()
            right += [int(p) == s[2] for p, s in zip(pred, chunk, strict=True)]
    model.train()
    right_t = torch.tensor(right, dtype=torch.float32)
    junction = torch.tensor([s[3] for s in ev])
    return float(right_t.mean()), float(right_t[junction].mean())


def main() -> None:
    steps, device = int(sys.argv[1]), sys.argv[2]
    thetas = [float(a) for a in sys.argv[3:]] or [5e6]
    width, heads = int(os.environ.get("WIDTH", 128)), int(os.environ.get("HEADS", 2))
    layers, batch = int(os.environ.get("LAYERS", 6)), int(os.environ.get("BATCH", 32))
    border = int(os.environ.get("BORDER", 7))
    if device == "cpu":
        torch.set_num_threads(int(os.environ.get("THREADS", 2)))
    eval_mazes, train_mazes = probe_mazes()
    train, ev = states(train_mazes), states(eval_mazes)
    print(f"{len(train)} training states; eval {len(ev)} ({sum(s[3] for s in ev)} at junctions); "
          f"width {width}, {heads} heads, {layers} layers, border {border}, batch {batch}")  # fmt: skip
    for theta in thetas:
        folder = tempfile.mkdtemp(prefix="pixprobe")
        text = {
            "hidden_size": width,
            "intermediate_size": 4 * width,
            "num_attention_heads": heads,
            "num_key_value_heads": max(1, heads // 2),
            "head_dim": width // heads,
            "num_hidden_layers": layers,
        }
        built = build_model(
            "small",
            folder,
            arch="qwen3_vl",
            image_size=SIZE * CELL + 2 * border,
            patch_size=CELL,
            merge_size=1,
            text_overrides=text,
            image_mean=[float(os.environ["MEAN"])] * 3 if "MEAN" in os.environ else None,
            image_std=[float(os.environ["STD"])] * 3 if "STD" in os.environ else None,
            position_table=os.environ.get("POSITION_TABLE", "sincos"),
            overwrite=True,
        )
        del built
        model, processor = load_policy(folder)
        model.config.text_config.rope_parameters["rope_theta"] = theta
        rotary = model.model.language_model.rotary_emb
        head_dim = width // heads
        inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
        rotary.inv_freq = inv
        rotary.original_inv_freq = inv
        chat = ChatFormat(processor)
        torch.manual_seed(0)
        head = torch.nn.Linear(width, len(DIRECTIONS))
        model, head = model.to(device), head.to(device)
        model.train()
        frames_train = Frames(chat, train_mazes, border)
        frames_ev = Frames(chat, eval_mazes, border)
        image_spread, query_spread = input_dependence(model, frames_ev, ev[::30][:64], device)
        print(f"theta {theta:g} at initialisation: image embeddings vary across frames by "
              f"{image_spread:.1%} of their spread, the query's state by {query_spread:.1%} "
              "of its size")  # fmt: skip
        params = list(model.parameters()) + list(head.parameters())
        opt = torch.optim.AdamW(params, lr=1e-3, weight_decay=0.0)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 100))
        workers = int(os.environ.get("WORKERS", 0))
        loader = torch.utils.data.DataLoader(
            TrainBatches(frames_train, train, batch, steps),
            batch_size=None,
            num_workers=workers,
            prefetch_factor=4 if workers else None,
            pin_memory=device == "cuda",
        )
        start = time.perf_counter()
        for step, inputs in enumerate(loader, start=1):
            labels = inputs["labels"].to(device)
            loss = torch.nn.functional.cross_entropy(
                head(hidden(model, to_device(inputs, device))).float(), labels
            )
            optimizer_step(opt, sched, params, loss)
            if step % max(1, steps // int(os.environ.get("EVALS", 5))) == 0 or step == steps:
                all_, junction = accuracy(model, head, frames_ev, ev, device)
                print(
                    f"theta {theta:g} step {step:5d} ({time.perf_counter() - start:6.0f} s) "
                    f"loss {loss.item():.3f} | eval all {all_:.1%} junction {junction:.1%}",
                    flush=True,
                )


if __name__ == "__main__":
    main()
