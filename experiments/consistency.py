"""The consistency check, printed: engine logprobs vs one plain forward pass of the same weights.

Plays maze episodes with the KV-cached engine, recomputes every sampled token's logprob
with a plain forward pass (transformers' own M-RoPE positions, no cache), and prints the
largest and mean absolute difference. ``tests/test_rollout.py`` bounds it at 1e-4.

    python experiments/consistency.py [--preset tiny] [--device cpu] [--dtype float32]
"""

from __future__ import annotations

import argparse
import tempfile

import torch

from clew.data.rows import generate_rows
from clew.envs.base import text_corpus
from clew.inference.engine import InferenceEngine
from clew.inference.sampling import SamplingParams, banned_token_ids
from clew.models import build_model, load_policy
from clew.models.chat import ChatFormat
from clew.rollout.loop import RolloutSettings, play


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--preset", default="tiny")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    args = p.parse_args()
    rows = generate_rows(
        "maze_2d/small", 4, env_options={"cell_px": 28, "action_format": "keyword"}
    )
    with tempfile.TemporaryDirectory() as tmp:
        build_model(args.preset, tmp, corpus=text_corpus(), image_size=196, overwrite=True)
        model, processor = load_policy(tmp, args.dtype, args.device)
        model.eval()
        chat = ChatFormat(processor)
        settings = RolloutSettings(2, 6, 8192, SamplingParams(temperature=1.0, max_tokens=8))
        trajs = play(InferenceEngine(model, chat), rows, settings, seed=0)
        banned = banned_token_ids(chat)
        diffs = []
        for t in trajs:
            ids = torch.tensor([t.token_ids], device=model.device)
            pixels, grid = t.vision_inputs(chat)
            with torch.no_grad():
                logits = (
                    model(
                        input_ids=ids,
                        attention_mask=torch.ones_like(ids),
                        pixel_values=pixels.to(model.device, model.dtype),
                        image_grid_thw=grid.to(model.device),
                        mm_token_type_ids=(ids == chat.image_token_id).int(),
                    )
                    .logits[0, :-1]
                    .float()
                )
            logits[:, banned] = float("-inf")
            lp = torch.log_softmax(logits, -1).gather(-1, ids[0, 1:, None]).squeeze(-1).cpu()
            mask = torch.tensor(t.loss_mask[1:], dtype=torch.bool)
            diffs.append((lp[mask] - torch.tensor(t.logprobs[1:])[mask]).abs())
        d = torch.cat(diffs)
        print(
            f"{len(trajs)} episodes, {d.numel()} sampled tokens, {args.preset} {args.dtype} on {args.device}: "
            f"largest |engine - plain forward| logprob difference {d.max():.2e}, mean {d.mean():.2e}"
        )


if __name__ == "__main__":
    main()
