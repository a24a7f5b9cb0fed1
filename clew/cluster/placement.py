"""Where a run's policy workers go: Ray to start or join, and the GPUs a placement needs.

A run with several workers needs Ray. ``connect_ray`` joins the cluster named by
``RAY_ADDRESS`` (a ``ray job submit`` entrypoint has it set), or else starts an embedded
instance of its own (``start_local_ray``) that is shut down with the run. An address that
does not answer fails within seconds, saying so: ``ray.init`` itself would retry for minutes.

The embedded instance is always a new one (``address="local"``): a cluster started on the
machine by ``ray start``, running or dead with its ``ray_current_cluster`` file left
behind, never changes what a run does. Every listener it opens (GCS, raylet, workers, the
driver, the dashboard agent and its metrics export port) binds 127.0.0.1. Ray binds them
to the address it detects for the node unless ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER`` is
off, and it reads that variable once, when ``ray`` is first imported: ``loopback_only``
turns Ray's copy of it off while the instance starts (its processes inherit the variable),
then puts both back, so a later ``ray.init`` that joins a cluster in this process finds
the node's real address.

Workers go into one placement group with one bundle each: ``{GPU: 1, CPU: 1}`` for the
``policy_num_nodes * policy_num_gpus_per_node`` GPU workers (``STRICT_PACK`` on one node,
``PACK`` over several, so a node's workers sit together), ``{CPU: 1}`` for
``num_cpu_workers`` (``PACK``). A placement the cluster cannot hold is refused before any
model loads, naming the keys and what the cluster has, and a placement group that is not
placed within the placement timeout (``PlacementConfig.placement_timeout``: the key
``trainer.placement.timeout_s``, or SkyRL's ``SKYRL_RAY_PG_TIMEOUT_IN_S``) fails with what
was asked and what is free, never hangs.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any
from urllib.parse import urlparse

import torch

from clew.config.schema import PlacementConfig
from clew.errors import ClewError, ConfigError

GPU_KEYS = "trainer.placement.policy_num_nodes x trainer.placement.policy_num_gpus_per_node"
CPU_KEY = "trainer.placement.num_cpu_workers"


def check_reachable(address: str, timeout_s: float = 10.0) -> None:
    """Fail unless something listens at ``address`` (``host:port``, ``ray://host:port``);
    ``auto`` and addresses without a port are left to Ray."""
    parsed = urlparse(address if "://" in address else f"ray://{address}")
    try:
        host, port = parsed.hostname, parsed.port
    except ValueError:
        host, port = None, None
    if not host or not port:
        return
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            pass
    except OSError as e:
        raise ClewError(
            f"the Ray cluster at RAY_ADDRESS={address} does not answer ({host}:{port}: "
            f"{e.strerror or e}): start it there (`ray start --head`), correct RAY_ADDRESS, "
            "or unset it to run on an embedded Ray on this machine"
        ) from None


def connect_ray(num_cpus: int | None) -> bool:
    """Join the cluster at ``RAY_ADDRESS``, or else start a new Ray instance on this
    machine with ``num_cpus`` CPUs (``start_local_ray``). True when this call joined or
    started Ray (the caller shuts it down); Ray already running here: False."""
    import ray

    if ray.is_initialized():
        return False
    if address := os.environ.get("RAY_ADDRESS"):
        check_reachable(address)
        try:
            ray.init(address="auto", log_to_driver=True)
        except Exception as e:  # an address that does not answer: say which
            raise ClewError(f"could not join the Ray cluster at RAY_ADDRESS={address}: {e}") from e
        return True
    start_local_ray(num_cpus)
    return True


LOOPBACK_VAR = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"


@contextmanager
def loopback_only() -> Iterator[None]:
    """Inside: a Ray instance started by this process binds every listener to 127.0.0.1.
    Ray's ``ENABLE_RAY_CLUSTER`` (read from ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER`` when ray
    is imported) is off, and so is the variable, which the instance's processes inherit."""
    from ray._private import ray_constants

    saved_var, saved_flag = os.environ.get(LOOPBACK_VAR), ray_constants.ENABLE_RAY_CLUSTER
    os.environ[LOOPBACK_VAR] = "0"
    ray_constants.ENABLE_RAY_CLUSTER = False
    try:
        yield
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = saved_flag
        if saved_var is None:
            os.environ.pop(LOOPBACK_VAR, None)
        else:
            os.environ[LOOPBACK_VAR] = saved_var


def start_local_ray(num_cpus: int | None = None, **options: Any) -> None:
    """Start a new Ray instance of this process's own on this machine, every listener on
    127.0.0.1, whatever ``RAY_ADDRESS`` or a ``ray_current_cluster`` file names.
    ``num_cpus``: the CPUs it offers (None: the machine's); ``options`` go to ``ray.init``
    (``include_dashboard`` is off unless they say otherwise)."""
    import ray

    options.setdefault("include_dashboard", False)
    with loopback_only():
        ray.init(address="local", num_cpus=num_cpus, **options)


def local_gpus() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def check_gpus(pl: PlacementConfig, found: float, where: str) -> None:
    """Refuse a GPU placement ``where`` cannot hold (``found`` GPUs)."""
    if pl.num_gpus > found:
        raise ConfigError(
            f"{GPU_KEYS} = {pl.policy_num_nodes} x {pl.policy_num_gpus_per_node} = "
            f"{pl.num_gpus} GPUs asked, but {where} has {found:g}: lower them, or on a machine "
            "without GPUs set them to 1 and use trainer.placement.num_cpu_workers (or "
            "trainer.device=cpu for one worker in this process)"
        )


def worker_placement_group(pl: PlacementConfig, on_gpus: bool) -> Any:
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
    timeout_s, source = pl.placement_timeout()
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
