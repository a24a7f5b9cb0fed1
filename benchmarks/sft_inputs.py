"""The host-side inputs of SFT: pixel patches for a batch, and building demonstrations.

1. Pixel patches. An SFT step (and the trainer's forward) encodes every frame of every
   sequence in the batch. Baseline: the Qwen2-VL PIL image processor, called once per
   sequence as the worker did before ``clew.models.pixels``; clew:
   ``ChatFormat.encode_images`` (the vectorised path for same-size frames). Both outputs
   are checked equal before timing.
2. Demonstrations per second on ``maze_2d/easy`` (``clew.trainer.demonstrations.demonstrations``).
   Baseline: the same code with a ``ChatFormat`` that encodes every frame with the image
   processor and tokenizes every text anew (what it did before); both must give the same
   tokens.
3. The attention mask of a batch with an image window (``keep_last_k_images=1``): collate
   plus ``model_inputs``. Baseline: what the trainer did before, a dense ``[L, L]`` mask
   built per sequence and copied into ``[B, 1, W, W]``, then an additive float mask made
   with two full-size temporaries; clew: ``[B, W]`` vectors per batch, expanded where the
   model runs (``clew.models.visibility.visibility_from_vectors``). Both masks are
   checked equal. (On a GPU the expansion runs on the device and the host only builds the
   vectors.)
4. A batch's pixels from frames to the model's device: encode every sequence, collate,
   the pixels on the device (``as_patches``). Baseline: float patches built on the host and copied (what
   clew did before ``Frames``); clew: the frames travel as bytes and are patched on the
   device. Both ``pixel_values`` are checked equal.

    python benchmarks/sft_inputs.py [--sequences 64] [--frames 14] [--cell-px 14] [--demos 300]
        [--device cpu] [--patch-size 16 --merge-size 2]

With ``--cell-px 28 --patch-size 16 --merge-size 2`` (Qwen3-VL's geometry on
``maze_2d/easy``'s 252 px frames) the processor resizes every frame to 256 px, and so does
clew's path (``clew.models.pixels``).
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch

from clew.data.rows import generate_rows
from clew.envs import make
from clew.envs.maze.actions import Action, format_action
from clew.envs.maze.solver import shortest_actions
from clew.models import build_model
from clew.models.chat import ChatFormat
from clew.models.pixels import as_patches
from clew.models.visibility import visibility_mask
from clew.train.model_batch import collate, encode_vision
from clew.trainer.demonstrations import demonstrations


class BaselineChat(ChatFormat):
    """Encodes every frame with the image processor and tokenizes every text anew."""

    def _encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def encode_images(self, images):
        out = self.image_processor(images=images, return_tensors="pt")
        return out["pixel_values"], out["image_grid_thw"]

    def user_turn(self, text, images, *, first, after_reply_end=True, pixels=True):
        return super().user_turn(text, images, first=first, after_reply_end=after_reply_end)


def best_of(fn, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def frames(n_seq: int, n_frames: int, cell_px: int) -> list[list]:
    out = []
    for seed in range(n_seq):
        env = make("maze_2d/easy", cell_px=cell_px, max_turns=64)
        seq = [env.reset(seed=seed).images[0]]
        for d in shortest_actions(env.maze)[: n_frames - 1]:
            obs, *_ = env.step(format_action(Action("move", d), env.action_format))
            seq.append(obs.images[0])
        out.append(seq)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sequences", type=int, default=64)
    ap.add_argument("--frames", type=int, default=14)
    ap.add_argument("--cell-px", type=int, default=14)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--demos", type=int, default=300)
    ap.add_argument("--device", default="cpu")
    ap.add_argument(
        "--patch-size",
        type=int,
        default=None,
        help="the processor's patch (default: --cell-px, so no frame is resized)",
    )
    ap.add_argument("--merge-size", type=int, default=1)
    args = ap.parse_args()
    side = 9 * args.cell_px
    patch = args.patch_size or args.cell_px
    with tempfile.TemporaryDirectory() as tmp:
        factor = patch * args.merge_size
        built = build_model(
            "tiny",
            Path(tmp) / "m",
            image_size=side if side % factor == 0 else None,  # else the processor resizes
            patch_size=patch,
            merge_size=args.merge_size,
        )
    chat = ChatFormat(built.processor)
    batch = frames(args.sequences, args.frames, args.cell_px)
    n_images = sum(len(s) for s in batch)

    def baseline() -> list:
        return [chat.image_processor(images=s, return_tensors="pt") for s in batch]

    def clew() -> list:
        return [chat.encode_images(s) for s in batch]

    for ref, ours in zip(baseline(), clew(), strict=True):
        assert torch.equal(ref["pixel_values"], ours[0])
    for name, fn in (("image processor (baseline)", baseline), ("clew encode_images", clew)):
        best = best_of(fn, args.repeats)
        print(
            f"{name:28s} {best * 1000:8.1f} ms per batch of {args.sequences} sequences "
            f"({n_images} frames of {side} px): {n_images / best:9.0f} frames/s"
        )

    opts = {"cell_px": args.cell_px, "max_turns": 32, "action_format": "keyword"}
    rows = generate_rows("maze_2d/easy", args.demos, "train", env_options=opts)
    chats = {
        "demonstrations (baseline)": BaselineChat(built.processor),
        "clew demonstrations": chat,
    }
    made = {name: demonstrations(rows, c, 0.0, 0) for name, c in chats.items()}
    first, second = made.values()
    assert [d.token_ids for d in first] == [d.token_ids for d in second]
    for name, c in chats.items():
        best = best_of(lambda c=c: demonstrations(rows, c, 0.0, 0), args.repeats)
        print(f"{name:28s} {args.demos / best:8.0f} per second ({args.demos} maze_2d/easy rows)")

    windowed = made["clew demonstrations"][: args.sequences]
    for demo in windowed:
        demo.image_window = 1
    vision = [encode_vision(d, chat) for d in windowed]

    def mask_baseline() -> torch.Tensor:
        batch = collate(windowed, chat, vision=vision)
        width = max(batch.lengths)
        dense = torch.zeros(len(windowed), 1, width, width, dtype=torch.bool)
        for row, demo in enumerate(windowed):
            n = len(demo.token_ids)
            dense[row, 0, :n, :n] = visibility_mask(
                demo.token_ids, demo.chunk_starts, chat.image_token_id, 1
            )
            dense[row, 0, n:, :n] = True
        mask = torch.zeros(dense.shape, dtype=torch.float32)
        return mask.masked_fill(~dense, torch.finfo(torch.float32).min)

    def mask_clew() -> torch.Tensor:
        return collate(windowed, chat, vision=vision).model_inputs("cpu")["attention_mask"]

    assert torch.equal(mask_baseline(), mask_clew())
    tokens = sum(len(d.token_ids) for d in windowed)
    for name, fn in (
        ("attention mask (baseline)", mask_baseline),
        ("clew attention mask", mask_clew),
    ):
        best = best_of(fn, args.repeats)
        print(
            f"{name:28s} {best * 1000:8.1f} ms per batch of {len(windowed)} episodes "
            f"({tokens} tokens, longest {max(len(d.token_ids) for d in windowed)})"
        )

    def sync() -> None:
        if args.device.startswith("cuda"):
            torch.cuda.synchronize()

    def pixels_baseline() -> torch.Tensor:
        host = [chat.encode_images(list(d.images)) for d in windowed]
        out = as_patches(collate(windowed, chat, vision=host).pixel_values, args.device)
        sync()
        return out

    def pixels_clew() -> torch.Tensor:
        batch = collate(windowed, chat, vision=[encode_vision(d, chat) for d in windowed])
        out = as_patches(batch.pixel_values, args.device)
        sync()
        return out

    assert torch.equal(pixels_baseline(), pixels_clew())
    n_frames = sum(len(d.images) for d in windowed)
    for name, fn in (
        ("float patches on the host", pixels_baseline),
        ("clew Frames, patched there", pixels_clew),
    ):
        best = best_of(fn, args.repeats)
        print(
            f"{name:28s} {best * 1000:8.1f} ms per batch of {len(windowed)} episodes "
            f"({n_frames} frames to {args.device})"
        )


if __name__ == "__main__":
    main()
