"""Full training checkpoints: what a resumed run needs to continue exactly.

A checkpoint holds the worker group's state (trainable weights, optimizer, scheduler),
the sampler's position, the global step, every RNG state of this process, and the
resolved config. The storage layer (``layout``) makes it atomic; this module decides what
goes in, checks that a checkpoint fits the run resuming from it (same model, same LoRA
shape, same batch geometry) and lists the differences when it does not, and exports the
inference-ready adapter next to it.
"""

from __future__ import annotations

import json
import random
import tempfile
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch

from clew.checkpoint.layout import (
    commit_checkpoint,
    download_checkpoint,
    find_resume_step,
    prune_checkpoints,
    step_dir,
)
from clew.checkpoint.storage import Storage, join
from clew.config import save_config
from clew.errors import CheckpointError
from clew.metrics import truncate_history

STATE_FILE = "trainer_state.pt"

# Config keys whose change makes a checkpoint's weights or optimizer meaningless for the run.
COMPATIBILITY_KEYS = (
    ("trainer", "policy", "model", "path"),
    ("trainer", "policy", "model", "lora", "rank"),
    ("trainer", "policy", "model", "lora", "alpha"),
    ("trainer", "policy", "model", "lora", "target_modules"),
    ("trainer", "train_batch_size"),
    ("trainer", "seed"),
    ("generator", "n_samples_per_prompt"),
)


# Values the restored optimizer state carries (AdamW's param groups): a resumed run goes on
# with the checkpoint's, whatever this run's config says, so a change is reported.
OPTIMIZER_STATE_KEYS = tuple(
    ("trainer", "policy", "optimizer_config", k) for k in ("lr", "adam_betas", "weight_decay")
)


def rng_states() -> dict[str, Any]:
    return {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
    }


def set_rng_states(states: dict[str, Any]) -> None:
    random.setstate(states["python"])
    np.random.set_state(states["numpy"])
    torch.set_rng_state(states["torch"])
    if states.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(states["cuda"])


def _dig(d: dict[str, Any], keys: tuple[str, ...]) -> Any:
    for k in keys:
        d = d.get(k, {}) if isinstance(d, dict) else {}
    return d


def config_differences(
    saved: dict[str, Any],
    current: dict[str, Any],
    fields: tuple[tuple[str, ...], ...] = COMPATIBILITY_KEYS,
) -> list[str]:
    out = []
    for keys in fields:
        a, b = _dig(saved, keys), _dig(current, keys)
        if a != b:
            out.append(f"{'.'.join(keys)}: checkpoint {a!r}, this run {b!r}")
    return out


class Checkpointer:
    """Saves, resumes and exports for one run (``trainer.ckpt_path`` / ``trainer.export_path``)."""

    def __init__(self, cfg: Any, run_dir: Path) -> None:
        t = cfg.trainer
        self.cfg = cfg
        self.run_dir = run_dir
        self.ckpt_path = t.ckpt_path or str(run_dir / "ckpts")
        self.export_path = t.export_path or str(run_dir / "exports")
        self.storage = Storage.for_path(self.ckpt_path)
        self.export_storage = Storage.for_path(self.export_path)

    def save(self, trainer: Any) -> str:
        step = trainer.state.global_step
        with tempfile.TemporaryDirectory(prefix="clew-ckpt-") as tmp:
            torch.save(
                {
                    "global_step": step,
                    "loop": dict(vars(trainer.state)),
                    "group": trainer.group.state_dict(),
                    "sampler": vars(trainer.sampler.state()),
                    "rng": rng_states(),
                    "config": self.cfg.model_dump(mode="python"),
                },
                Path(tmp) / STATE_FILE,
            )
            save_config(self.cfg, tmp)
            where = commit_checkpoint(self.storage, self.ckpt_path, step, tmp)
        prune_checkpoints(self.storage, self.ckpt_path, self.cfg.trainer.max_ckpts_to_keep)
        return where

    def maybe_resume(self, trainer: Any) -> int | None:
        t = self.cfg.trainer
        if t.resume_mode == "none":
            return None
        if t.resume_mode == "from_path":
            source = str(t.resume_path)
            storage = Storage.for_path(source)
            if not storage.exists(join(source, STATE_FILE)) and not storage.exists(
                join(source, "manifest.json")
            ):
                raise CheckpointError(
                    f"trainer.resume_path={source} is not a clew checkpoint (expected a "
                    f"global_step_N folder holding {STATE_FILE} and manifest.json)"
                )
        else:
            step, notes = find_resume_step(self.storage, self.ckpt_path)
            for note in notes:
                warnings.warn(note, stacklevel=2)
            if step is None:
                return None
            source, storage = step_dir(self.ckpt_path, step), self.storage
        with tempfile.TemporaryDirectory(prefix="clew-resume-") as tmp:
            download_checkpoint(storage, source, tmp)
            state = torch.load(Path(tmp) / STATE_FILE, weights_only=False)
        current = self.cfg.model_dump(mode="python")
        diffs = config_differences(state["config"], current)
        if diffs:
            raise CheckpointError(
                f"the checkpoint at {source} does not fit this run:\n  "
                + "\n  ".join(diffs)
                + "\nstart a new ckpt_path, or set trainer.resume_mode=none"
            )
        ignored = config_differences(state["config"], current, OPTIMIZER_STATE_KEYS)
        if ignored:
            warnings.warn(
                "the optimizer state resumes with the checkpoint's values, not this run's:\n  "
                + "\n  ".join(ignored)
                + "\nto train with the new ones, start a new ckpt_path (or trainer.resume_mode=none)"
                " from the exported policy",
                stacklevel=2,
            )
        trainer.group.load_state_dict(state["group"])
        trainer.sampler.load_state(state["sampler"])
        for key, value in state.get("loop", {}).items():  # absent before session 7
            setattr(trainer.state, key, value)
        trainer.state.global_step = int(state["global_step"])
        set_rng_states(state["rng"])
        truncate_history(self.run_dir, trainer.state.global_step)
        print(f"resumed from {source} at global step {trainer.state.global_step}")
        return trainer.state.global_step

    def dump_eval(self, trajs: Any, metrics: dict[str, float], name: str) -> str:
        """Eval trajectories, metrics and a few GIFs under ``export_path/eval/NAME``."""
        from clew.evaluation import dump_eval

        dest = join(self.export_path, "eval", name)
        with tempfile.TemporaryDirectory(prefix="clew-eval-") as tmp:
            dump_eval(trajs, metrics, Path(tmp), num_gifs=2)
            self.export_storage.put_dir(tmp, dest)
        return dest

    def export(self, trainer: Any) -> str:
        step = trainer.state.global_step
        return self._export_to(trainer, join(self.export_path, f"global_step_{step}", "policy"))

    def _export_to(self, trainer: Any, dest: str) -> str:
        with tempfile.TemporaryDirectory(prefix="clew-export-") as tmp:
            trainer.group.export(tmp)
            self.export_storage.put_dir(tmp, dest)
        return dest

    def export_best(self, trainer: Any, value: float) -> str:
        """The policy as export_path/best/policy, best.json beside it (step, pass@1). The
        old best is removed before the new one is written, and best.json is written last:
        a best.json on disk always describes the policy beside it."""
        folder = join(self.export_path, "best")
        if self.export_storage.exists(folder):
            self.export_storage.rm_tree(folder)
        dest = self._export_to(trainer, join(folder, "policy"))
        record = {"step": trainer.state.global_step, "eval/all/pass_at_1": value, "policy": dest}
        self.export_storage.write_text(join(folder, "best.json"), json.dumps(record, indent=2))
        return dest
