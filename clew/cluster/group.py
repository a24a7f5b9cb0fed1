"""The worker-group interface the training loop drives, and its single-process form.

The loop never touches a model: it asks a worker group to generate trajectories, to
update the policy from them, and to save or restore its state. ``LocalWorkerGroup`` runs
one plain ``PolicyWorker`` in this process with the rollout engine sharing its weights;
the Ray form places one such worker per GPU behind the same methods, so the loop is the
same on a laptop and on a cluster.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

import torch

from clew.algorithms.step_advantages import turn_token_advantages
from clew.data.rows import Row
from clew.inference.engine import InferenceEngine
from clew.rollout.loop import RolloutSettings, play
from clew.rollout.trajectory import Trajectory
from clew.train.lora import merged_for_rollouts
from clew.train.worker import PPOSettings


def ppo_settings(cfg: Any) -> PPOSettings:
    a = cfg.trainer.algorithm
    temperature = cfg.generator.sampling_params.temperature
    return PPOSettings(
        eps_clip_low=a.eps_clip_low,
        eps_clip_high=a.eps_clip_high,
        clip_ratio_c=a.clip_ratio_c,
        loss_reduction=a.loss_reduction,
        max_seq_len=cfg.generator.max_input_length,
        kl_loss_coef=a.kl_loss_coef if a.use_kl_loss else 0.0,
        kl_estimator=a.kl_estimator_type,
        entropy_loss_coef=a.entropy_loss_coef if a.use_entropy_loss else 0.0,
        temperature=temperature if temperature > 0 else 1.0,
        allowed_tokens=tuple(cfg.generator.sampling_params.allowed_tokens or ()),
    )


class WorkerGroup(Protocol):
    world_size: int

    def generate(
        self, rows: Sequence[Row], settings: RolloutSettings, seed: int
    ) -> list[Trajectory]: ...

    def update(
        self,
        trajs: Sequence[Trajectory],
        advantages: torch.Tensor | Sequence[torch.Tensor],
        cfg: Any,
    ) -> dict[str, float]: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...

    def export(self, path: str | Path) -> None: ...


class LocalWorkerGroup:
    """One policy worker in this process; the engine samples from the very modules it trains."""

    world_size = 1

    def __init__(self, worker: Any, engine: InferenceEngine, cfg: Any | None = None) -> None:
        self.worker = worker
        self.engine = engine
        if cfg is not None:
            # A token text that is not one token fails here, before any rollout.
            for sp in (cfg.generator.sampling_params, cfg.generator.eval_sampling_params):
                if sp.allowed_tokens:
                    engine.allowed_ids(tuple(sp.allowed_tokens))

    def generate(
        self, rows: Sequence[Row], settings: RolloutSettings, seed: int, progress=None
    ) -> list[Trajectory]:
        self.worker.model.eval()
        # A LoRA policy samples with its adapter merged: one matmul a layer, not three
        with merged_for_rollouts(self.worker.model):
            return play(self.engine, rows, settings, seed=seed, progress=progress)

    def update(
        self,
        trajs: Sequence[Trajectory],
        advantages: torch.Tensor | Sequence[torch.Tensor],
        cfg: Any,
    ) -> dict[str, float]:
        """PPO updates; ``advantages`` is ``Float[N]`` (one per trajectory, on every reply
        token) or ``N`` tensors ``Float[T_i]`` (one per turn, on that turn's reply tokens)."""
        ppo = ppo_settings(cfg)
        t = cfg.trainer
        per_token = [
            turn_token_advantages(adv.float(), tr.loss_mask)
            if adv.dim() == 1
            else adv * torch.tensor(tr.loss_mask, dtype=torch.float32)
            for adv, tr in zip(advantages, trajs, strict=True)
        ]
        old = [torch.tensor(tr.logprobs, dtype=torch.float32) for tr in trajs]
        ref = None
        if t.algorithm.use_kl_loss:
            ref = self.worker.compute_logprobs(
                trajs,
                ppo.temperature,
                t.micro_forward_batch_size_per_gpu,
                adapter_enabled=False,
                allowed=ppo.allowed_tokens,
            )
        mini = t.policy_mini_batch_size * cfg.generator.n_samples_per_prompt // self.world_size
        self.worker.model.train()
        try:
            return self.worker.ppo_update(
                trajs,
                old,
                per_token,
                ref,
                ppo,
                mini,
                t.micro_train_batch_size_per_gpu,
                t.update_epochs_per_batch,
            )
        finally:
            self.worker.model.eval()

    def state_dict(self) -> dict[str, Any]:
        return self.worker.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.worker.load_state_dict(state)

    def export(self, path: str | Path) -> None:
        """The inference-ready policy: the adapter (or full weights) plus processor files."""
        self.worker.save_pretrained(path)
        self.worker.chat.processor.save_pretrained(path)
