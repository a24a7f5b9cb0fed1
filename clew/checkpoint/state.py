"""Full training checkpoints: what a resumed run needs to continue exactly.

A stage hands the checkpointer a mapping of named stateful objects (anything with
``state_dict()`` / ``load_state_dict()``: for GRPO the loop, the sampler and the worker group;
for SFT the SFT loop and its worker), and the checkpointer saves their states with every RNG
state of this process and the resolved config. It reads no object's internals: what a
resumed run needs is each object's own business. The storage layer (``layout``) makes a save
atomic; this module decides what goes in, checks that a checkpoint fits the run resuming
from it (per stage: same model, same adapter shape, same batch geometry, same data) and
lists the differences when it does not, and writes the inference-ready exports.
"""

from __future__ import annotations

import json
import random
import tempfile
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

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
from clew.errors import CheckpointError, ConfigError
from clew.metrics import truncate_history

STATE_FILE = "trainer_state.pt"
FORMAT = "clew-state/2"

Keys = tuple[tuple[str, ...], ...]
Exporter = Callable[[Path], None]
"""Writes an inference-ready policy (weights and processor files) into a local folder."""


class Stateful(Protocol):
    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


# Per stage: config keys whose change makes a checkpoint's weights, optimizer or data
# position meaningless for the run.
COMPATIBILITY_KEYS: dict[str, Keys] = {
    "grpo": (
        ("trainer", "policy", "model", "path"),
        ("trainer", "policy", "model", "lora", "rank"),
        ("trainer", "policy", "model", "lora", "alpha"),
        ("trainer", "policy", "model", "lora", "target_modules"),
        ("trainer", "train_batch_size"),
        ("trainer", "seed"),
        ("generator", "n_samples_per_prompt"),
    ),
    "sft": (
        ("sft", "model_path"),
        ("data", "train_data"),
        ("sft", "lora", "rank"),
        ("sft", "lora", "alpha"),
        ("sft", "lora", "dropout"),
        ("sft", "lora", "target_modules"),
        ("sft", "batch_size"),
        ("sft", "seed"),
        ("environment", "env_class"),
        ("environment", "env_id"),
        ("environment", "env_options"),
    ),
}

# Values the restored optimizer state carries (AdamW's param groups): a resumed run goes on
# with the checkpoint's, whatever this run's config says, so a change is reported.
_OPTIMIZER_FIELDS = ("lr", "adam_betas", "weight_decay")
OPTIMIZER_STATE_KEYS: dict[str, Keys] = {
    "grpo": tuple(("trainer", "policy", "optimizer_config", k) for k in _OPTIMIZER_FIELDS),
    "sft": tuple(("sft", "optimizer_config", k) for k in _OPTIMIZER_FIELDS),
}


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


def config_differences(saved: dict[str, Any], current: dict[str, Any], fields: Keys) -> list[str]:
    out = []
    for keys in fields:
        a, b = _dig(saved, keys), _dig(current, keys)
        if a != b:
            out.append(f"{'.'.join(keys)}: checkpoint {a!r}, this run {b!r}")
    return out


@dataclass
class ResumePoint:
    """A checkpoint chosen for resuming, read and checked against this run."""

    source: str
    state: dict[str, Any]

    @property
    def step(self) -> int:
        return int(self.state["global_step"])


class Checkpointer:
    """Saves, resumes and exports for one run of one stage.

    ``stage`` picks the compatibility keys and where checkpoints and exports go: for
    ``grpo`` ``trainer.ckpt_path`` / ``trainer.export_path``, for ``sft`` ``RUN_DIR/ckpts``
    and ``sft.export_path`` (each null meaning ``RUN_DIR/ckpts`` / ``RUN_DIR/exports``).
    """

    def __init__(self, cfg: Any, run_dir: Path, stage: str = "grpo") -> None:
        if stage not in COMPATIBILITY_KEYS:
            raise ConfigError(f"unknown stage {stage!r}; accepted: {', '.join(COMPATIBILITY_KEYS)}")
        t = cfg.trainer
        self.cfg = cfg
        self.stage = stage
        self.run_dir = Path(run_dir)
        ckpt_path = t.ckpt_path if stage == "grpo" else None
        export_path = t.export_path if stage == "grpo" else cfg.sft.export_path
        self.ckpt_path = ckpt_path or str(self.run_dir / "ckpts")
        self.export_path = export_path or str(self.run_dir / "exports")
        self.storage = Storage.for_path(self.ckpt_path)
        self.export_storage = Storage.for_path(self.export_path)
        self._point: ResumePoint | None = None
        self._looked = False

    # -- saving -----------------------------------------------------------------------
    def save(self, step: int, objects: Mapping[str, Stateful]) -> str:
        """Commit ``objects``' states, the RNG states and the config as ``global_step_<step>``."""
        with tempfile.TemporaryDirectory(prefix="clew-ckpt-") as tmp:
            torch.save(
                {
                    "format": FORMAT,
                    "stage": self.stage,
                    "global_step": step,
                    "objects": {name: obj.state_dict() for name, obj in objects.items()},
                    "rng": rng_states(),
                    "config": self.cfg.model_dump(mode="python"),
                },
                Path(tmp) / STATE_FILE,
            )
            save_config(self.cfg, tmp)
            where = commit_checkpoint(self.storage, self.ckpt_path, step, tmp)
        prune_checkpoints(self.storage, self.ckpt_path, self.cfg.trainer.max_ckpts_to_keep)
        return where

    # -- resuming ---------------------------------------------------------------------
    def resume_point(self) -> ResumePoint | None:
        """The checkpoint ``trainer.resume_mode`` asks for, read and checked; None if none.

        Raises ``CheckpointError`` when it is not a checkpoint of this stage or does not fit
        this run's config (each differing key: the checkpoint's value and this run's). Read
        once: a stage may check before it builds anything, then restore from the same read.
        """
        if self._looked:
            return self._point
        t = self.cfg.trainer
        self._looked = True
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
        self._check(source, state)
        self._point = ResumePoint(source, state)
        return self._point

    def _check(self, source: str, state: dict[str, Any]) -> None:
        if state.get("format") != FORMAT:
            raise CheckpointError(
                f"the checkpoint at {source} was written by an older clew (format "
                f"{state.get('format', 'clew-state/1')!r}, this clew reads {FORMAT!r}); start a "
                "new checkpoint folder, or set trainer.resume_mode=none"
            )
        if state["stage"] != self.stage:
            raise CheckpointError(
                f"the checkpoint at {source} is of the {state['stage']} stage, not {self.stage}; "
                "give this stage its own run folder, or set trainer.resume_mode=none"
            )
        current = self.cfg.model_dump(mode="python")
        diffs = config_differences(state["config"], current, COMPATIBILITY_KEYS[self.stage])
        if diffs:
            raise CheckpointError(
                f"the checkpoint at {source} does not fit this run:\n  "
                + "\n  ".join(diffs)
                + "\nstart a new run folder (or checkpoint path), or set trainer.resume_mode=none"
            )
        ignored = config_differences(state["config"], current, OPTIMIZER_STATE_KEYS[self.stage])
        if ignored:
            warnings.warn(
                "the optimizer state resumes with the checkpoint's values, not this run's:\n  "
                + "\n  ".join(ignored)
                + "\nto train with the new ones, start a new run folder (or "
                "trainer.resume_mode=none) from the exported policy",
                stacklevel=3,
            )

    def maybe_resume(self, objects: Mapping[str, Stateful]) -> int | None:
        """Restore ``objects`` and the RNG states from the resume point; its step, or None.

        The run's ``metrics.jsonl`` is cut back to that step, so the resumed run's history
        reads as one run's.
        """
        point = self.resume_point()
        if point is None:
            return None
        saved = point.state["objects"]
        if set(saved) != set(objects):
            raise CheckpointError(
                f"the checkpoint at {point.source} holds the states of {sorted(saved)}, but "
                f"this run restores {sorted(objects)}"
            )
        for name, obj in objects.items():
            obj.load_state_dict(saved[name])
        set_rng_states(point.state["rng"])
        truncate_history(self.run_dir, point.step)
        self._point = None  # the weights it holds are restored; free them
        print(f"resumed from {point.source} at global step {point.step}", flush=True)
        return point.step

    # -- exports ----------------------------------------------------------------------
    def dump_eval(self, trajs: Any, metrics: dict[str, float], name: str) -> str:
        """Eval trajectories, metrics and a few GIFs under ``export_path/eval/NAME``."""
        from clew.rollout.evaluation import dump_eval

        dest = join(self.export_path, "eval", name)
        with tempfile.TemporaryDirectory(prefix="clew-eval-") as tmp:
            dump_eval(trajs, metrics, Path(tmp), num_gifs=2)
            self.export_storage.put_dir(tmp, dest)
        return dest

    def export(self, write: Exporter, step: int) -> str:
        """The policy as ``export_path/global_step_<step>/policy``."""
        return self.export_to(write, join(self.export_path, f"global_step_{step}", "policy"))

    def export_final(self, write: Exporter) -> str:
        """The policy as ``export_path/final/policy``."""
        return self.export_to(write, join(self.export_path, "final", "policy"))

    def export_to(self, write: Exporter, dest: str) -> str:
        with tempfile.TemporaryDirectory(prefix="clew-export-") as tmp:
            write(Path(tmp))
            self.export_storage.put_dir(tmp, dest)
        return dest

    def export_best(
        self,
        write: Exporter,
        step: int,
        value: float,
        metric: str = "eval/all/pass_at_1",
        also: Mapping[str, float] | None = None,
    ) -> str:
        """The policy as export_path/best/policy, best.json beside it: its step, the
        ``metric`` that picked it (``picked_by``) with its ``value``, any figures ``also``
        gives (the eval set's pass@1 of a step the selection set picked) and the policy's
        path. The old best is removed before the new one is written, and best.json is
        written last: a best.json on disk always describes the policy beside it."""
        folder = join(self.export_path, "best")
        if self.export_storage.exists(folder):
            self.export_storage.rm_tree(folder)
        dest = self.export_to(write, join(folder, "policy"))
        record = {"step": step, "picked_by": metric, metric: value, **(also or {}), "policy": dest}
        self.export_storage.write_text(join(folder, "best.json"), json.dumps(record, indent=2))
        return dest
