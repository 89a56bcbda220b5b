"""Multi-node Ray clusters: which nodes are alive, actors pinned to labelled nodes, and the probe
that every node sees the run's work dir.

* :func:`alive_nodes` lists the cluster's alive nodes (``ray.nodes()``, Ray's public API).
* :func:`label_strategy` turns a node label (a custom resource given to ``ray start --resources``)
  into a *soft* :class:`~ray.util.scheduling_strategies.NodeAffinitySchedulingStrategy` on an alive
  node that has it: the actor runs there while that node lives, and a restarted or replacement
  actor runs on a surviving node once it is lost (a hard custom-resource request would stay
  pending forever: LAB-NOTES "a task that needs that node's custom resource stays pending").
* :func:`check_shared_dirs` is run by the pipeline before the first stage on a cluster of more
  than one node: the driver writes a token file under each directory, a zero-CPU task pinned to
  each alive node (hard node affinity) reads it and writes one back, and the driver reads that.
  The recipes (``ray_configs/``) assume ``work_dir`` is on a file system every node mounts at the
  same path; without this check a node that does not see it fails late, on an actor, with a
  missing-file error about a model dir.

Sources: Ray's scheduling strategies (docs.ray.io "Scheduling", ``ray/util/scheduling_strategies.py``
read, Ray 2.60) and Ray's fault-tolerance guide (actor restarts, ``max_task_retries``).
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path
from typing import Any, Sequence

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

SHARED_FS_FIX = ("put work_dir on a file system every node mounts at the same path (NFS, Lustre, GPFS...; "
                 "on SLURM a directory under the shared $DARTS_BENCH_SHARED), or on Kubernetes mount one "
                 "ReadWriteMany volume at that path in every pod spec (ray_configs/rayjob.yaml: volumeMounts "
                 "/mnt/shared)")


class SharedDirError(OSError):
    """A Ray node does not see the run's work dir (raised by :func:`check_shared_dirs`; an ``OSError``,
    so the CLI reports it as a user's error, without a traceback)."""


def alive_nodes() -> list[dict[str, Any]]:
    """The alive nodes of the connected cluster: dicts with ``node_id`` (hex str), ``ip`` (str) and
    ``resources`` (name -> float), sorted by IP then id.

    Raises:
        RuntimeError: Ray is not initialised in this process.
    """
    if not ray.is_initialized():
        raise RuntimeError("alive_nodes: Ray is not initialised (call darts_bench.ray_instance.init_ray first)")
    nodes = [dict(node_id=n["NodeID"], ip=n["NodeManagerAddress"], resources=dict(n.get("Resources", {})))
             for n in ray.nodes() if n.get("Alive")]
    return sorted(nodes, key=lambda n: (n["ip"], n["node_id"]))


def node_of_label(label: str, nodes: Sequence[dict[str, Any]] | None = None) -> dict[str, Any] | None:
    """The first alive node (:func:`alive_nodes` order) started with the custom resource ``label``, or None."""
    for n in alive_nodes() if nodes is None else nodes:
        if n["resources"].get(label, 0) > 0:
            return n
    return None


def label_lost(label: str) -> bool:
    """Whether a node that had the label ``label`` is in the cluster's table as dead (its machine lost); a dead
    node whose resources the table no longer lists counts as one that may have had it."""
    dead = [n for n in ray.nodes() if not n.get("Alive")]
    return any(n.get("Resources", {}).get(label, 0) > 0 or not n.get("Resources") for n in dead)


def label_strategy(label: str) -> NodeAffinitySchedulingStrategy | None:
    """Soft node affinity to the alive node labelled ``label`` (None: ``label`` is ''), so that a
    restart after that node is lost lands on a surviving node.

    Raises:
        RuntimeError: no alive node has the label (names the label and the nodes' resources, and the fix).
    """
    if not label:
        return None
    nodes = alive_nodes()
    node = node_of_label(label, nodes)
    if node is None:
        have = {n["ip"]: sorted(k for k in n["resources"] if not k.startswith("node:")) for n in nodes}
        raise RuntimeError(
            f"ray.actor_nodes: no alive node has the label {label!r} (alive nodes and their resources: {have}); "
            f"start that node with `ray start ... --resources '{{\"{label}\": 1}}'` or fix ray.actor_nodes")
    return NodeAffinitySchedulingStrategy(node_id=node["node_id"], soft=True)


def _probe(token_path: str, expect: str, reply_path: str) -> dict[str, Any]:
    """Runs on one node: read ``token_path`` (must hold ``expect``), then write ``reply_path``."""
    node = ray.get_runtime_context().get_node_id()
    out: dict[str, Any] = {"node_id": node, "pid": os.getpid()}
    try:
        got = Path(token_path).read_text()
    except OSError as e:
        return {**out, "error": f"reading {token_path}: {type(e).__name__}: {e}"}
    if got != expect:
        return {**out, "error": f"{token_path} holds {got[:40]!r}, not the token the driver wrote: another file "
                                f"system is mounted at that path on this node"}
    try:
        tmp = Path(f"{reply_path}.tmp")
        tmp.write_text(node)
        os.replace(tmp, reply_path)
    except OSError as e:
        return {**out, "error": f"writing {reply_path}: {type(e).__name__}: {e}"}
    return out


_probe_remote = ray.remote(num_cpus=0, max_retries=0)(_probe)


def check_shared_dirs(dirs: Sequence[str | os.PathLike], timeout: float = 120.0) -> list[dict[str, Any]]:
    """Check that every alive node reads and writes each of ``dirs`` as this driver does.

    For each dir the driver writes ``.darts-probe-<uuid>/token`` (atomically), then one zero-CPU task
    per alive node (hard node affinity) reads it and writes ``reply-<node id>``, which the driver reads
    back; the probe dir is removed afterwards. A cluster of one node is not probed.

    Returns:
        one dict per probed (node, dir): ``node_id``, ``ip``, ``dir``.
    Raises:
        SharedDirError: a node could not read the token, wrote nothing the driver sees, or did not answer
            within ``timeout`` s; the message names every failing node (id and IP), the path and the fix
            (:data:`SHARED_FS_FIX`).
    """
    nodes = alive_nodes()
    if len(nodes) < 2:
        return []
    failures: list[str] = []
    checked: list[dict[str, Any]] = []
    for d in dirs:
        d = Path(d).resolve()
        probe_dir = d / f".darts-probe-{uuid.uuid4().hex[:12]}"
        probe_dir.mkdir(parents=True)
        token_path, expect = probe_dir / "token", uuid.uuid4().hex
        tmp = probe_dir / "token.tmp"
        tmp.write_text(expect)
        os.replace(tmp, token_path)
        try:
            refs = {}
            for n in nodes:
                reply = probe_dir / f"reply-{n['node_id']}"
                strat = NodeAffinitySchedulingStrategy(node_id=n["node_id"], soft=False)
                refs[_probe_remote.options(scheduling_strategy=strat).remote(str(token_path), expect, str(reply))] = \
                    (n, reply)
            ready, pending = ray.wait(list(refs), num_returns=len(refs), timeout=timeout)
            for ref in pending:
                n, _ = refs[ref]
                failures.append(f"node {n['node_id']} ({n['ip']}): no answer from a probe task within {timeout:g} s "
                                f"(dir {d})")
                ray.cancel(ref, force=True)
            for ref in ready:
                n, reply = refs[ref]
                try:
                    res = ray.get(ref)
                except Exception as e:  # noqa: BLE001 - the node died, the worker crashed: report it as the node's
                    failures.append(f"node {n['node_id']} ({n['ip']}): the probe task failed: {type(e).__name__}: "
                                    f"{str(e).splitlines()[0] if str(e) else ''} (dir {d})")
                    continue
                if res.get("error"):
                    failures.append(f"node {n['node_id']} ({n['ip']}) does not see the work dir: {res['error']}")
                elif not reply.is_file() or reply.read_text() != n["node_id"]:
                    failures.append(f"node {n['node_id']} ({n['ip']}) wrote {reply}, but the driver does not see it: "
                                    f"the node has another file system at {d}")
                else:
                    checked.append(dict(node_id=n["node_id"], ip=n["ip"], dir=str(d)))
        finally:
            for f in probe_dir.glob("*"):
                f.unlink(missing_ok=True)
            probe_dir.rmdir()
    if failures:
        raise SharedDirError(f"{len(failures)} of {len(nodes)} Ray nodes cannot use the run's directories, so actors "
                           f"there would fail on a missing model dir: " + "; ".join(failures) + f". Fix: "
                           f"{SHARED_FS_FIX}.")
    return checked
