"""Evaluation through an endpoint: the eval set's episodes played concurrently.

Each episode is a sequence of requests, so episodes run on a pool of threads, ``concurrency``
at a time; the server batches the requests in flight together. The metrics and the dump
(``metrics.json``, ``trajectories.jsonl``, GIFs) are ``clew.rollout.evaluation``'s, so a policy
evaluated through its server reads as one evaluated in-process: with greedy decoding the
same episodes, actions and pass@1 (replies that re-encode to their sampled tokens, see
``clew.agent.messages``). An episode the server cuts short ends as ``server_error`` and is
counted and written with the others; a refused first request, an unreachable server or a
refused key ends the run (``clew.agent.episode``).
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from tqdm import tqdm

from clew.agent.endpoint import Endpoint
from clew.agent.episode import play_episode
from clew.data.rows import Row
from clew.rollout.evaluation import dump_eval, eval_metrics
from clew.rollout.loop import RolloutSettings
from clew.rollout.trajectory import Trajectory, apply_reward_rule


def evaluate_endpoint(
    endpoint: Endpoint,
    rows: Sequence[Row],
    settings: RolloutSettings,
    *,
    concurrency: int = 16,
    output_dir: str | Path | None = None,
    num_gifs: int = 4,
    show_progress: bool = True,
    seed: int = 0,
) -> tuple[dict[str, float], list[Trajectory]]:
    """Metrics and trajectories of one pass over ``rows`` (``n_samples_per_prompt`` episodes
    each), in (row, sample) order as ``clew.rollout.evaluation.evaluate`` gives them."""
    endpoint.check()
    specs = [
        (g, s, row) for g, row in enumerate(rows) for s in range(settings.n_samples_per_prompt)
    ]
    with (
        tqdm(total=len(specs), desc="eval episodes", disable=not show_progress, unit="ep") as bar,
        ThreadPoolExecutor(max(1, concurrency), thread_name_prefix="clew-eval") as pool,
    ):

        def one(spec: tuple[int, int, Row]) -> Trajectory:
            g, s, row = spec
            traj = play_episode(
                endpoint,
                row.env_id,
                row.options(),
                int(row.seed),
                settings,
                group=g,
                sample=s,
                sampling_seed=seed,
            )
            bar.update(1)
            return traj

        futures = [pool.submit(one, spec) for spec in specs]
        try:
            trajs = [f.result() for f in futures]
        except BaseException:
            for f in futures:  # one failure (the server gone) ends the run, not each episode
                f.cancel()
            raise
    apply_reward_rule(trajs, settings.reward_rule)
    metrics = eval_metrics(trajs, rows, settings.max_turns)
    if output_dir is not None:
        dump_eval(trajs, metrics, Path(output_dir), num_gifs)
    return metrics, trajs
