"""Starting or joining the run's Ray instance (:func:`init_ray`), shared by the Ray executor
(:mod:`darts_bench.executors.ray_executor`) and Ray Train in ``train``
(:mod:`darts_bench.surgery.train_deepspeed`).

A module of its own, outside ``executors``, so that ``surgery`` can start Ray without importing
the executors (which import the surgery heads): no import circle between the two packages.
"""

from __future__ import annotations

import contextlib
import os

import ray


def _local_cpu_count() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def init_ray(address: str | None, num_cpus: int | None = None, temp_dir: str | None = None) -> bool:
    """Start (``address`` None) or join (``"auto"``, ``ray://...``, ``host:port``) a Ray instance.

    A local instance has node IP 127.0.0.1 and listens on loopback only (see :func:`_loopback_only`),
    runs without dashboard, with ``num_cpus`` (default: the CPUs this process may use) and its
    session files under ``temp_dir`` (default Ray's, ``/tmp/ray``; keep it short: Ray's socket paths
    must fit in 107 bytes). Returns
    whether this call initialised Ray (False when this process was already connected, in which
    case the caller must not shut it down).
    """
    if ray.is_initialized():
        return False
    if address is None:
        kwargs = dict(address="local", num_cpus=num_cpus or _local_cpu_count(), include_dashboard=False,
                      log_to_driver=False, _node_ip_address="127.0.0.1")
        if temp_dir:
            kwargs["_temp_dir"] = str(temp_dir)
        with _loopback_only():
            try:
                ray.init(**kwargs)
            except TypeError:  # a Ray without the private option: the loopback switch alone suffices
                kwargs.pop("_node_ip_address")
                ray.init(**kwargs)
    else:
        ray.init(address=address, log_to_driver=False)
    return True


@contextlib.contextmanager
def _loopback_only():
    """Make a single-node Ray started in this block use 127.0.0.1 as its node IP.

    Ray resolves ``127.0.0.1`` given as node IP to the machine's routable address (and its servers
    then listen on every interface) unless multi-node clusters are off, which is what
    ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` does for ``ray start``. Here Ray is already imported, so
    the switch it reads from that variable is flipped for the duration of ``ray.init``; afterwards
    every process of the instance has 127.0.0.1 and binds to it.
    """
    try:
        from ray._private import ray_constants
    except ImportError:  # pragma: no cover - layout changed: fall back to Ray's defaults
        yield
        return
    old = getattr(ray_constants, "ENABLE_RAY_CLUSTER", None)
    ray_constants.ENABLE_RAY_CLUSTER = False
    try:
        yield
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = old
