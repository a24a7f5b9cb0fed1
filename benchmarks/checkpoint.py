"""Checkpoint cost: save and load time of a full training checkpoint, by preset.

clew's checkpoint (``Checkpointer.save``: trainable weights, AdamW state, scheduler, RNG,
sampler position, config, then a manifest with sha256 of every file and an atomic rename) is timed
beside the baseline a user would write: one ``torch.save`` of the same state to a single
file, with no manifest, checksum or atomic commit. Loading is timed the same way
(``maybe_resume``: checksum verification, then ``torch.load`` and restore).

    python benchmarks/checkpoint.py --preset base --lora-rank 32
    python benchmarks/checkpoint.py --preset base --lora-rank 0
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch

from clew.checkpoint.state import Checkpointer
from clew.config import load_config
from clew.data.sampler import ResumableSampler
from clew.envs.base import text_corpus
from clew.models import build_model
from clew.train import PolicyWorker, WorkerSettings


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--preset", default="base")
    p.add_argument("--lora-rank", type=int, default=32)
    p.add_argument("--device", default="cpu")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        build_model(args.preset, tmp / "model", corpus=text_corpus(), overwrite=True)
        settings = WorkerSettings(lr=1e-4, lora_rank=args.lora_rank, lora_alpha=32)
        worker = PolicyWorker.from_pretrained(tmp / "model", settings, device=args.device)
        # One optimizer step so AdamW holds its two moments per trainable parameter.
        for p_ in worker.model.parameters():
            if p_.requires_grad:
                p_.grad = torch.zeros_like(p_)
        worker.optimizer.step()
        cfg = load_config(
            None,
            [
                f"trainer.policy.model.path={tmp / 'model'}",
                f"trainer.policy.model.lora.rank={args.lora_rank}",
                f"trainer.ckpt_path={tmp / 'ckpts'}",
                "trainer.resume_mode=latest",
            ],
        )
        objects = {"group": worker, "sampler": ResumableSampler(list(range(8)), 4)}
        ckpt = Checkpointer(cfg, tmp / "run")
        t0 = time.perf_counter()
        ckpt.save(1, objects)
        save_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        torch.save({"group": worker.state_dict()}, tmp / "baseline.pt")
        base_save_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        Checkpointer(cfg, tmp / "run").maybe_resume(objects)
        load_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        worker.load_state_dict(torch.load(tmp / "baseline.pt", weights_only=False)["group"])
        base_load_s = time.perf_counter() - t0
        size = sum(f.stat().st_size for f in (tmp / "ckpts").rglob("*") if f.is_file())
        trainable = worker.trainable_parameters()
        print(
            f"preset {args.preset}, lora rank {args.lora_rank}: {trainable:,} trainable parameters, "
            f"checkpoint {size / 2**20:.1f} MiB on {args.device}"
        )
        print(f"{'':<28} {'save s':>8} {'load s':>8}")
        print(f"{'clew (manifest, sha256, atomic)':<28} {save_s:>8.2f} {load_s:>8.2f}")
        print(f"{'baseline torch.save/load':<28} {base_save_s:>8.2f} {base_load_s:>8.2f}")


if __name__ == "__main__":
    main()
