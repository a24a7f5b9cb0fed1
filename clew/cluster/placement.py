"""The placement of a run's policy workers on Ray, and the GPUs it needs.

Ray itself is joined or started by ``clew.ray_connect`` (``connect_ray``). Workers go into
one placement group with one bundle each: ``{GPU: 1, CPU: 1}`` for the
``policy_num_nodes * policy_num_gpus_per_node`` GPU workers (``STRICT_PACK`` on one node,
``PACK`` over several, so a node's workers sit together), ``{CPU: 1}`` for
``num_cpu_workers`` (``PACK``). A placement the cluster cannot hold is refused before any
model loads, naming the keys and what the cluster has, and a placement group that is not
placed within the placement timeout (``PlacementSettings.timeout_s``: the key
``trainer.placement.timeout_s``, or SkyRL's ``SKYRL_RAY_PG_TIMEOUT_IN_S``) fails with what
was asked and what is free, never hangs. These functions take ``PlacementSettings``, which
the trainer builds from ``trainer.placement`` (``clew.trainer.launch.placement_settings``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from clew.errors import ClewError, ConfigError

GPU_KEYS = "trainer.placement.policy_num_nodes x trainer.placement.policy_num_gpus_per_node"
CPU_KEY = "trainer.placement.num_cpu_workers"


@dataclass(frozen=True)
class PlacementSettings:
    """Where the policy workers go: ``policy_num_nodes x policy_num_gpus_per_node`` GPU
    workers, or ``num_cpu_workers`` CPU workers, placed within ``timeout_s`` seconds
    (``timeout_source``: the key or variable that number came from, for the messages)."""

    policy_num_nodes: int
    policy_num_gpus_per_node: int
    num_cpu_workers: int
    timeout_s: float
    timeout_source: str

    @property
    def num_gpus(self) -> int:
        """GPU workers in total (one per GPU)."""
        return self.policy_num_nodes * self.policy_num_gpus_per_node


def local_gpus() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def check_gpus(pl: PlacementSettings, found: float, where: str) -> None:
    """Refuse a GPU placement ``where`` cannot hold (``found`` GPUs)."""
    if pl.num_gpus > found:
        raise ConfigError(
            f"{GPU_KEYS} = {pl.policy_num_nodes} x {pl.policy_num_gpus_per_node} = "
            f"{pl.num_gpus} GPUs asked, but {where} has {found:g}: lower them, or on a machine "
            "without GPUs set them to 1 and use trainer.placement.num_cpu_workers (or "
            "trainer.device=cpu for one worker in this process)"
        )


def worker_placement_group(pl: PlacementSettings, on_gpus: bool) -> Any:
    """A ready placement group of one bundle per policy worker: ``{GPU: 1, CPU: 1}`` for
    GPU workers, ``{CPU: 1}`` for CPU workers."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    resources = ray.cluster_resources()
    if on_gpus:
        check_gpus(pl, resources.get("GPU", 0), "the Ray cluster")
        bundle, count = {"GPU": 1, "CPU": 1}, pl.num_gpus
        strategy = "STRICT_PACK" if pl.policy_num_nodes == 1 else "PACK"
        shape = f"{pl.policy_num_nodes} x {pl.policy_num_gpus_per_node}"
        asked, kind = f"{count} GPU workers ({strategy}, {GPU_KEYS} = {shape})", "GPU"
    else:
        bundle, count, strategy = {"CPU": 1}, pl.num_cpu_workers, "PACK"
        if count > (found := resources.get("CPU", 0)):
            raise ConfigError(
                f"{CPU_KEY} = {count} CPU workers asked, but the Ray cluster has {found:g} "
                "CPUs: lower it"
            )
        asked, kind = f"{count} CPU workers ({CPU_KEY} = {count})", "CPU"
    timeout_s, source = pl.timeout_s, pl.timeout_source
    pg = placement_group([bundle] * count, strategy=strategy)
    ready, _ = ray.wait([pg.ready()], timeout=timeout_s)
    if not ready:
        remove_placement_group(pg)
        free = ray.available_resources().get(kind, 0)
        raise ClewError(
            f"Ray could not place {asked} within {source} = "
            f"{timeout_s:g} s: the cluster has {resources.get(kind, 0):g} {kind}s, "
            f"{free:g} free now (other jobs hold the rest, or one node cannot hold a "
            "STRICT_PACK group); free them, lower the count, or raise the timeout"
        )
    return pg


def rendezvous_in(pg: Any) -> str:
    """A ``tcp://ip:port`` on the node of ``pg``'s first bundle, where rank 0 will listen."""
    import ray
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    @ray.remote(num_cpus=0)
    def address() -> str:
        import socket

        with socket.socket() as s:
            s.bind(("", 0))
            return f"tcp://{ray.util.get_node_ip_address()}:{s.getsockname()[1]}"

    strategy = PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=0)
    return ray.get(address.options(scheduling_strategy=strategy).remote())
