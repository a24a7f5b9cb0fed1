"""Where a run's policy workers go: Ray to start or join, and the GPUs a placement needs.

A run with several workers needs Ray. ``connect_ray`` joins the cluster named by
``RAY_ADDRESS`` (a ``ray job submit`` entrypoint has it set), or else starts an embedded
instance on this machine that listens on loopback only and is shut down with the run.

GPU workers (``policy_num_nodes * policy_num_gpus_per_node`` of them) go into one placement
group with one ``{GPU: 1, CPU: 1}`` bundle each: ``STRICT_PACK`` on one node, ``PACK``
over several, so a node's workers sit together. A placement the cluster cannot hold is
refused before any model loads, naming the keys and the GPUs found, and a placement group
that is not placed within ``timeout_s`` fails with what was asked, never hangs.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from clew.config.schema import PlacementConfig
from clew.errors import ClewError, ConfigError

GPU_KEYS = "trainer.placement.policy_num_nodes x trainer.placement.policy_num_gpus_per_node"


def connect_ray(num_cpus: int | None) -> bool:
    """Join the cluster at ``RAY_ADDRESS``, or start Ray here with ``num_cpus`` CPUs.
    True when this call started Ray (the caller shuts it down); already running: False."""
    import ray

    if ray.is_initialized():
        return False
    if address := os.environ.get("RAY_ADDRESS"):
        try:
            ray.init(address="auto", log_to_driver=True)
        except Exception as e:  # an address that does not answer: say which
            raise ClewError(f"could not join the Ray cluster at RAY_ADDRESS={address}: {e}") from e
        return True
    # Every listener on 127.0.0.1: an embedded instance is this machine's business only.
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    ray.init(num_cpus=num_cpus, include_dashboard=False)
    return True


def local_gpus() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def check_gpus(pl: PlacementConfig, found: float, where: str) -> None:
    """Refuse a GPU placement ``where`` cannot hold (``found`` GPUs)."""
    if pl.num_gpus > found:
        raise ConfigError(
            f"{GPU_KEYS} = {pl.policy_num_nodes} x {pl.policy_num_gpus_per_node} = "
            f"{pl.num_gpus} GPUs asked, but {where} has {found:g}: lower them, or on a machine "
            "without GPUs set them to 1 and use trainer.placement.num_cpu_workers"
        )


def gpu_placement_group(pl: PlacementConfig, timeout_s: float = 120.0) -> Any:
    """A ready placement group of one ``{GPU: 1, CPU: 1}`` bundle per policy worker."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    check_gpus(pl, ray.cluster_resources().get("GPU", 0), "the Ray cluster")
    strategy = "STRICT_PACK" if pl.policy_num_nodes == 1 else "PACK"
    pg = placement_group([{"GPU": 1, "CPU": 1}] * pl.num_gpus, strategy=strategy)
    ready, _ = ray.wait([pg.ready()], timeout=timeout_s)
    if not ready:
        remove_placement_group(pg)
        raise ClewError(
            f"Ray could not place {pl.num_gpus} GPU workers ({strategy}, {GPU_KEYS} = "
            f"{pl.policy_num_nodes} x {pl.policy_num_gpus_per_node}) within {timeout_s:g} s; "
            f"the cluster has {ray.available_resources().get('GPU', 0):g} GPUs free"
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
