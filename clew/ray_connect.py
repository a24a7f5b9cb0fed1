"""Joining a Ray cluster, or starting a Ray instance of this process's own.

``connect_ray`` joins the cluster named by ``RAY_ADDRESS`` (a ``ray job submit`` entrypoint
has it set), or else starts an embedded instance (``start_local_ray``) that the caller shuts
down when it is done; ``join_ray`` only joins. An address that does not answer is refused
before ``ray.init`` is called, naming the address and what to do (``check_reachable``), as
``ray.init`` itself would retry for minutes. The embedded instance is always a new one
(``address="local"``): a cluster started on the machine by ``ray start``, running or dead
with its ``ray_current_cluster`` file left behind, never changes what a run does. Every
listener it opens (GCS, raylet, workers, the driver, the dashboard agent and its metrics
export port) binds 127.0.0.1. Ray binds them to the address it detects for the node unless
``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER`` is off, and it reads that variable once, when ``ray``
is first imported: ``loopback_only`` turns Ray's copy of it off while the instance starts
(its processes inherit the variable), then puts both back, so a later ``ray.init`` that
joins a cluster in this process finds the node's real address. Both the trainer's worker
groups (``clew.trainer.launch``) and the ``ray`` metrics logger (``clew.metrics``) come to
Ray through here.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any
from urllib.parse import urlparse

from clew.errors import ClewError

LOOPBACK_VAR = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"


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


def join_ray(address: str) -> None:
    """Join the Ray cluster at ``address`` (the value of ``RAY_ADDRESS``), after checking
    that it answers; a ``ClewError`` names the address when it cannot be joined."""
    import ray

    check_reachable(address)
    try:
        ray.init(address="auto", log_to_driver=True)
    except Exception as e:  # an address that does not answer: say which
        raise ClewError(f"could not join the Ray cluster at RAY_ADDRESS={address}: {e}") from e


def connect_ray(num_cpus: int | None) -> bool:
    """Join the cluster at ``RAY_ADDRESS``, or else start a new Ray instance on this
    machine with ``num_cpus`` CPUs (``start_local_ray``). True when this call joined or
    started Ray (the caller shuts it down); Ray already running here: False."""
    import ray

    if ray.is_initialized():
        return False
    if address := os.environ.get("RAY_ADDRESS"):
        join_ray(address)
        return True
    start_local_ray(num_cpus)
    return True


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
