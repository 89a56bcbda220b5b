"""Ray executor: one model per Ray actor, fixed-order shards spread over ``ray.num_actors`` actors.

Same interface and same outputs as :class:`darts_bench.executors.local.LocalExecutor`:

* :meth:`RayExecutor.map` runs one op (``generate_ids`` / ``generate`` / ``score`` / ``features``)
  on every payload (shard). Shards are submitted in payload order to whichever actor is free,
  collected with ``ray.wait`` as they finish, handed to ``on_result(i, result)`` in the driver (the
  driver persists them, so a resumed run redoes only missing shards) and returned in payload order.
* :meth:`RayExecutor.text_model` returns a :class:`RayTextModel` proxy (the :class:`TextModel`
  protocol) that cuts prompts into contiguous chunks and concatenates the actors' answers in order.

Identical results. A shard is a deterministic function of its payload: every actor runs the same
:class:`~darts_bench.executors.worker.ModelWorker` code as the local executor. For the text-model
proxy two more things make the output independent of the number of actors:

1. chunks are ``ray.shard_size`` rounded *up to a multiple of the batch size*, so every forward
   batch holds exactly the prompts (and hence the left padding) that
   :class:`~darts_bench.evaluate.hf_model.HFTextModel` would batch in-process;
2. every chunk is called with the call's ``seed``: sampling is seeded per (seed, prompt, sample
   index) (:func:`~darts_bench.evaluate.sampling.sample_seed`), never per batch, so it is
   reproducible and equal to the local executor's for any number of actors.

Fault tolerance. Actors are created with ``max_restarts`` / ``max_task_retries`` from
:class:`~darts_bench.config.RayConfig`, so Ray itself restarts an actor that dies mid-shard and
retries the shard. When Ray gives up (restarts exhausted), the driver replaces the actor with a
fresh one and resubmits the shard, at most ``max_task_retries`` more times; a shard that still
fails raises :class:`RuntimeError` naming the shard index, the op and the model dir. An exception
raised *by the op* (bad payload, unknown op, broken checkpoint ...) is deterministic and is not
retried: it is raised at once as a :class:`RuntimeError` naming the shard, chained to the original
error. Exceptions from ``on_result`` (e.g. the NaN check when persisting) propagate unchanged.
Numpy results are copied out of the object store (writable, as from the local executor).

Several nodes. ``ray.actor_nodes`` gives each actor slot a node label (a custom resource of
``ray start --resources``), placed with soft node affinity
(:func:`~darts_bench.executors.cluster.label_strategy`), so that a restart after that node is lost
lands on a surviving node instead of waiting forever for the label. On a cluster of more than one
node the driver polls the node table every second while shards are in flight; a node that dies
while it holds actors of the running group is logged once, by id and IP, with the actor slots on
it and the shards in flight there, which Ray's restarts (or the driver's replacement actors) redo;
:attr:`RayExecutor.node_losses` keeps these records. Before the first stage the pipeline checks
that every node sees the work dir (:func:`~darts_bench.executors.cluster.check_shared_dirs`).

Resources. Actor groups (``num_actors`` actors of one model) live in an LRU pool keyed by
``(model_dir, batch_size)``: the correction head is not part of the key but of each call's payload
(``head_dir``), and the actor swaps it on the loaded model before the op
(:meth:`ModelWorker.set_head <darts_bench.executors.worker.ModelWorker.set_head>`), so a merge and
all its corrected rows share one group and each actor loads its checkpoint once. A
:class:`RayTextModel` holds its group until closed (proxies of the same model share one, whatever
their heads; the evaluate stage's backend keeps one open per current model dir and one for the
judge: :class:`~darts_bench.evaluate.engines.base.HeldProxies`). ``map`` releases its group when
done, like the local executor drops its worker, so no actor holds CPUs/GPUs between calls (other
Ray work of the run, e.g. DeepSpeed through Ray Train in ``train``, shares the instance); ``keep_idle=True`` keeps
the most recent such group loaded for the next call instead (expert generation, then expert
features). A group that would not fit next to the resident ones (in the cluster's total CPUs/GPUs)
first evicts the least recently used groups that have no call in flight; a proxy whose group was
evicted recreates it on its next call. On a local instance the number of actors per model is
capped at what the machine can hold (a warning says so) instead of waiting forever for resources.
:attr:`RayExecutor.actor_starts` counts the actors started per model dir (each one loads it).

Every head of a merge in one pass (the evaluate stage's ``evaluate.one_pass``): a proxy's
:meth:`RayTextModel.multi_head` is a :class:`RayMultiHeadModel` on the same actor group whose
requests name their head slot; each actor serves its share with the multi-head model of its loaded
weights (``HFMultiHeadModel``, or the engine's ``VLLMMultiHeadModel``): one batched pass for the
rows' prompts instead of one per row. A slot's prompts are chunked as that slot's single-head proxy
chunks them, so outputs equal the row-by-row path's where the one pass is exact
(``darts_bench.stages.evaluate.one_pass_exact``: float32, not vLLM on a GPU).

Engines (``evaluate.backend: vllm``, and ``calibration.backend: vllm`` for the experts'
continuations). :meth:`RayExecutor.vllm_text_model` returns a
:class:`RayVLLMTextModel` over a group of ``num_actors`` actors each holding one engine of the
model dir (:class:`~darts_bench.executors.vllm_worker.VLLMWorker`; the engine class and settings
come from the caller, the vLLM backend :class:`~darts_bench.evaluate.engines.vllm.VLLMBackend`,
which also checks ``evaluate.vllm.tensor_parallel_size`` against ``num_gpus_per_actor``); the head
travels in each call's payload and is swapped in the running engine (``set_head``). Prompts are
split into one contiguous chunk per actor (data parallel), each with the call's seed (the engine
seeds each sample by its prompt and index): outputs equal one engine's. Engine groups are shut
down (engine-core and worker processes stopped by pid) before their actors are killed.

Which text models a row gets (and which group it holds) is the backends' decision
(:mod:`darts_bench.evaluate.engines`); this module only runs what it is asked to, and says it is
not in-process (:attr:`RayExecutor.in_process` False).

``python -m darts_bench.executors.ray_executor stop-head --temp-dir DIR --port PORT`` stops one
head node started with ``ray start --head --temp-dir DIR`` by pid (the alternative to ``ray stop``,
which stops every Ray process on the machine); see ``ray_configs/README.md``.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import threading
import time
from collections import Counter, OrderedDict, deque
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import ray
from ray.exceptions import RayActorError, RayTaskError
from tqdm.auto import tqdm

from darts_bench.api import ScoreContinuation
from darts_bench.executors.vllm_worker import VLLMWorker
from darts_bench.executors.worker import ModelWorker
from darts_bench.ray_instance import init_ray

log = logging.getLogger("darts_bench")


class _WorkerActor:
    """Body of one Ray actor: a :class:`ModelWorker` (or a subclass, or a
    :class:`~darts_bench.executors.vllm_worker.VLLMWorker`) holding one model."""

    def __init__(self, worker_cls: type, kwargs: dict[str, Any]):
        self.worker = worker_cls(**kwargs)

    def run(self, op: str, payload: dict[str, Any]) -> Any:
        return self.worker.run(op, payload)

    def pid(self) -> int:
        return os.getpid()

    def where(self) -> tuple[int, str, str]:
        """``(pid, node id, node IP)`` of this actor's process."""
        ctx = ray.get_runtime_context()
        return os.getpid(), ctx.get_node_id(), ray.util.get_node_ip_address()

    def close(self) -> None:
        """Release what the worker holds outside this process (a vLLM engine's processes)."""
        close = getattr(self.worker, "close", None)
        if close is not None:
            close()


_RemoteWorker = ray.remote(_WorkerActor)


@dataclass
class _Group:
    """``num_actors`` actors serving one key: ``("hf", model_dir, batch_size)`` or
    ``("engine", model_dir, batch_size, engine class, engine settings)``."""

    key: tuple
    kwargs: dict[str, Any]
    worker_cls: type = ModelWorker
    graceful: bool = False  # call the actors' close() before killing them (vLLM engines)
    actors: list = field(default_factory=list)
    nodes: list = field(default_factory=list)  # per slot: (node id, node IP) once the actor answered, else None
    busy: int = 0  # calls in flight (never evicted while > 0)

    @property
    def model_dir(self) -> str:
        return self.key[1]


class RayExecutor:
    """Runs shards on Ray actors, one model per actor (see the module docstring).

    Args:
        cfg: the run's :class:`~darts_bench.config.Config` (uses ``ray``, ``calibration.batch_size``,
            ``device``, ``torch_threads``).
        worker_cls: the worker class each actor holds (a :class:`ModelWorker` subclass; tests pass
            one that fails on purpose).
        keep_idle: keep the actors of the last ``map`` call loaded for the next call (see the
            module docstring); :meth:`release_idle` frees them.

    Attributes:
        in_process: False: models live in Ray actors (backends use their Ray layout).
        actor_starts: ``Counter`` model dir -> actors started for it so far (each loads the
            checkpoint or starts an engine; replacements of dead actors included).
        node_losses: one dict per node seen lost while it held actors of a running call:
            ``node_id``, ``ip``, ``model_dir``, ``slots``, ``shards_redone`` (shard indices of that
            call), ``time`` (epoch s).
    """

    name = "ray"
    in_process = False

    def __init__(self, cfg, worker_cls: type = ModelWorker, keep_idle: bool = False):
        self.cfg, self.rcfg = cfg, cfg.ray
        self.batch_size = cfg.calibration.batch_size
        self.device = cfg.device
        # one torch thread per reserved CPU unless the config says otherwise
        self.torch_threads = cfg.torch_threads or max(1, int(self.rcfg.num_cpus_per_actor))
        self.dtype = cfg.pool.dtype
        self.share_prefix = cfg.evaluate.share_prefix  # the HF workers' scores (evaluate.share_prefix)
        self.prefix_cache_mib = cfg.evaluate.prefix_cache_mib  # ... and their block cache across calls
        self.worker_cls, self.keep_idle = worker_cls, keep_idle
        self._owns_ray = init_ray(self.rcfg.address)
        self._local = self.rcfg.address is None
        # several nodes: poll the node table while shards are in flight (a lost node is logged by name)
        self._multi_node = not self._local and len(ray.nodes()) > 1
        self._poll_s = 1.0 if self._multi_node else None
        self._groups: OrderedDict[tuple, _Group] = OrderedDict()
        self._users: Counter = Counter()  # group key -> open RayTextModel proxies
        self._lock = threading.RLock()
        self._closed = False
        self.actor_starts: Counter = Counter()  # model dir -> actors started (each loads the model)
        self.node_losses: list[dict[str, Any]] = []  # one record per lost node seen (see _check_nodes)
        self._dead_seen: set[str] = set()
        self._labels_gone: set[str] = set()

    # --------------------------------------------------------------------------- actor groups
    def _actor_options(self, slot: int = 0) -> dict[str, Any]:
        """Resources and fault tolerance of the actor in ``slot``; with ``ray.actor_nodes`` its node
        label's soft node affinity (:func:`~darts_bench.executors.cluster.label_strategy`; a label that
        no alive node has any more, its node lost, places the actor anywhere, with a warning)."""
        r = self.rcfg
        opts = dict(num_cpus=r.num_cpus_per_actor, num_gpus=r.num_gpus_per_actor,
                    max_restarts=r.max_restarts, max_task_retries=r.max_task_retries)
        label = r.actor_nodes[slot % len(r.actor_nodes)] if r.actor_nodes else ""
        if label:
            from darts_bench.executors.cluster import label_lost, label_strategy

            try:
                opts["scheduling_strategy"] = label_strategy(label)
            except RuntimeError:
                if not label_lost(label):  # no node ever had it: a config error, not a lost node
                    raise
                if label not in self._labels_gone:  # once per label
                    self._labels_gone.add(label)
                    log.warning("ray: no alive node has the label %r any more (its node was lost); actors of "
                                "slot %d go to any node from now on", label, slot)
        return opts

    def _new_actor(self, g: _Group, slot: int = 0):
        self.actor_starts[g.model_dir] += 1
        return _RemoteWorker.options(**self._actor_options(slot)).remote(g.worker_cls, g.kwargs)

    def _check_nodes(self, g: _Group, inflight: dict) -> None:
        """Log (once per node) each node that died while it held actors of ``g``: its id and IP, the
        actor slots on it (Ray restarts them on a surviving node, or the driver replaces them) and the
        shards in flight there, which are redone. Recorded in :attr:`node_losses`."""
        hosted = {n[0] for n in g.nodes if n}
        if not hosted - self._dead_seen:
            return
        try:
            dead = {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes() if not n.get("Alive")}
        except Exception:  # noqa: BLE001 - the GCS is busy or gone: the next poll retries
            return
        for node_id in sorted(hosted & set(dead) - self._dead_seen):
            self._dead_seen.add(node_id)
            slots = [k for k, n in enumerate(g.nodes) if n and n[0] == node_id]
            shards = sorted(i for i, s in inflight.values() if s in slots)
            rec = dict(node_id=node_id, ip=dead[node_id], model_dir=g.model_dir, slots=slots, shards_redone=shards,
                       time=time.time())
            self.node_losses.append(rec)
            for k in slots:
                g.nodes[k] = None  # the restarted actor's node is read again when it next answers
            log.warning("ray: node %s (%s) lost: actor slot(s) %s of %s were on it and restart on a surviving "
                        "node; shard(s) %s in flight there are redone", node_id, dead[node_id], slots, g.model_dir,
                        shards or "none")

    def _note_node(self, g: _Group, slot: int) -> None:
        """Read the node of the actor in ``slot`` (after a restart) once it has answered a call."""
        if slot < len(g.nodes) and g.nodes[slot] is None:
            try:
                _, node_id, ip = ray.get(g.actors[slot].where.remote(), timeout=60)
            except Exception:  # noqa: BLE001 - read again after its next answer
                return
            g.nodes[slot] = (node_id, ip)
            log.info("ray: actor slot %d of %s now runs on node %s (%s)", slot, g.model_dir, node_id, ip)

    def _cluster_capacity(self) -> int | None:
        """How many actors of this size the cluster can hold at once (None: unknown)."""
        try:
            total = ray.cluster_resources()
        except Exception:  # pragma: no cover - a disconnected client
            return None
        r = self.rcfg
        fits = [math.floor(total.get("CPU", 0) / r.num_cpus_per_actor + 1e-9)]
        if r.num_gpus_per_actor > 0:
            fits.append(math.floor(total.get("GPU", 0) / r.num_gpus_per_actor + 1e-9))
        return min(fits)

    def _n_actors(self) -> int:
        n = self.rcfg.num_actors
        if not self._local:
            return n  # a cluster may autoscale: ask for what the config says
        cap = self._cluster_capacity()
        if cap is not None and cap < 1:
            raise RuntimeError(
                f"the local Ray instance cannot hold one actor with num_cpus={self.rcfg.num_cpus_per_actor}, "
                f"num_gpus={self.rcfg.num_gpus_per_actor} (resources: {ray.cluster_resources()}); "
                "lower ray.num_cpus_per_actor / ray.num_gpus_per_actor")
        if cap is not None and cap < n:
            log.warning("ray.num_actors=%d does not fit the local Ray instance; using %d actors per model", n, cap)
            return cap
        return n

    def _kill_group(self, g: _Group) -> None:
        if g.graceful and g.actors:  # stop the engines' own processes first (ray.kill would orphan them)
            try:
                ray.get([a.close.remote() for a in g.actors], timeout=120)
            except Exception as e:  # noqa: BLE001 - dead or hung actors are killed below either way
                log.warning("ray: closing the workers of %s: %s", g.model_dir, _cause(e))
        for a in g.actors:
            try:
                ray.kill(a, no_restart=True)
            except Exception:  # already dead
                pass
        g.actors = []
        self._groups.pop(g.key, None)

    def _make_room(self, n_new: int, keep: tuple) -> None:
        """Evict least recently used groups without calls in flight until ``n_new`` more actors fit."""
        cap = self._cluster_capacity()
        if cap is None:
            return
        resident = sum(len(g.actors) for g in self._groups.values())
        for key in list(self._groups):
            if resident + n_new <= cap:
                break
            g = self._groups[key]
            if key == keep or g.busy:
                continue
            log.info("ray: releasing actors of %s to make room", key[0])
            resident -= len(g.actors)
            self._kill_group(g)

    def _trim_idle(self, keep: tuple | None) -> None:
        """Kill the groups that no open proxy uses and that have no call in flight, except ``keep``."""
        for key in list(self._groups):
            g = self._groups[key]
            if key != keep and not self._users[key] and not g.busy:
                self._kill_group(g)

    def release_idle(self) -> None:
        """Kill every actor group that no open :class:`RayTextModel` uses (frees their CPUs/GPUs)."""
        with self._lock:
            self._trim_idle(keep=None)

    @staticmethod
    def _key(model_dir: str, batch_size: int) -> tuple:
        """Group key of an HF model: the head is not in it (it travels with each call)."""
        return ("hf", str(model_dir), int(batch_size))

    def _hf_spec(self, key: tuple, name: str) -> dict[str, Any]:
        return dict(worker_cls=self.worker_cls, graceful=False,
                    kwargs=dict(model_dir=key[1], head_dir=None, name=name, device=self.device, batch_size=key[2],
                                torch_threads=self.torch_threads, dtype=self.dtype,
                                share_prefix=self.share_prefix, prefix_cache_mib=self.prefix_cache_mib))

    def _acquire(self, key: tuple, name: str = "model", spec: dict[str, Any] | None = None) -> _Group:
        """The (possibly new) actor group for ``key``; marks it most recently used. ``spec``
        (``worker_cls``, ``kwargs``, ``graceful``) says how to start its actors (default: HF
        :class:`ModelWorker` actors of ``key``)."""
        if self._closed:
            raise RuntimeError("RayExecutor is closed")
        with self._lock:
            g = self._groups.get(key)
            if g is not None:
                self._groups.move_to_end(key)
                return g
            n = self._n_actors()
            self._make_room(n, keep=key)
            g = _Group(key=key, **(spec or self._hf_spec(key, name)))
            g.actors = [self._new_actor(g, k) for k in range(n)]
            g.nodes = [None] * n
            self._groups[key] = g
        try:  # wait for the models to load so a broken checkpoint is reported as such
            where = ray.get([a.where.remote() for a in g.actors])
            g.nodes = [(node_id, ip) for _, node_id, ip in where]
            log.debug("ray: %d actors of %s on nodes %s", len(where), g.model_dir, [ip for _, _, ip in where])
        except (RayActorError, RayTaskError) as e:
            with self._lock:
                self._kill_group(g)
            raise RuntimeError(f"starting Ray workers ({g.worker_cls.__name__}) for model {g.model_dir} failed: "
                               f"{_cause(e)}") from e
        return g

    def _replace_actor(self, g: _Group, slot: int) -> None:
        try:
            ray.kill(g.actors[slot], no_restart=True)
        except Exception:
            pass
        g.actors[slot] = self._new_actor(g, slot)
        if slot < len(g.nodes):
            g.nodes[slot] = None

    # ------------------------------------------------------------------------------- sharding
    def _run_shards(self, g: _Group, op: str, payloads: Sequence[dict[str, Any]], todo: list[int],
                    on_result: Callable[[int, Any], None] | None, desc: str) -> list[Any]:
        """Submit ``todo`` shards in order to free actors; collect with ``ray.wait`` as they finish."""
        results: list[Any] = [None] * len(payloads)
        pending = deque(todo)
        free = deque(range(len(g.actors)))
        inflight: dict[Any, tuple[int, int]] = {}  # object ref -> (shard, actor slot)
        resubmits: dict[int, int] = {}
        model_dir = g.model_dir
        bar = tqdm(total=len(todo), desc=desc or op, leave=False, disable=len(todo) < 2)
        g.busy += 1
        ok = False
        try:
            while pending or inflight:
                while pending and free:
                    i, slot = pending.popleft(), free.popleft()
                    inflight[g.actors[slot].run.remote(op, payloads[i])] = (i, slot)
                    node = g.nodes[slot] if slot < len(g.nodes) else None
                    log.debug("ray: shard %d of %s on %s -> actor slot %d on %s", i, op, model_dir, slot,
                              node[1] if node else "(node not known yet)")
                # poll, so that a lost node is named while its shards are redone (Ray retries them unseen)
                ready, _ = ray.wait(list(inflight), num_returns=1, timeout=self._poll_s)
                if self._multi_node:
                    self._check_nodes(g, inflight)
                for ref in ready:
                    i, slot = inflight.pop(ref)
                    try:
                        res = ray.get(ref)
                    except RayActorError as e:  # the actor died and Ray's own retries are spent
                        n = resubmits.get(i, 0) + 1
                        resubmits[i] = n
                        if n > self.rcfg.max_task_retries:
                            raise RuntimeError(
                                f"shard {i} of op {op!r} on model {model_dir} failed: its Ray worker died "
                                f"{n} times ({_cause(e)})") from e
                        if self._multi_node:
                            self._check_nodes(g, {ref: (i, slot), **inflight})
                        log.warning("ray: worker died on shard %d of %s (%s); retrying on a new actor "
                                    "(%d/%d)", i, op, model_dir, n, self.rcfg.max_task_retries)
                        self._replace_actor(g, slot)
                        pending.appendleft(i)
                        free.append(slot)
                        continue
                    except RayTaskError as e:  # the op raised: deterministic, do not retry
                        raise RuntimeError(f"shard {i} of op {op!r} on model {model_dir} failed: "
                                           f"{_cause(e)}") from e
                    free.append(slot)
                    if self._multi_node:
                        self._note_node(g, slot)
                    results[i] = res = _own(res)
                    if on_result is not None:
                        on_result(i, res)
                    bar.update(1)
            ok = True
        finally:
            bar.close()
            g.busy -= 1
            if not ok:  # drop work still queued on the actors: start clean next time
                with self._lock:
                    if not g.busy:
                        self._kill_group(g)
        return results

    # ------------------------------------------------------------------------------ interface
    def map(self, model_dir: str, op: str, payloads: Sequence[dict[str, Any]], *, head_dir: str | None = None,
            skip: set[int] = frozenset(), on_result: Callable[[int, Any], None] | None = None,
            desc: str = "") -> list[Any]:
        """Run ``op`` on every payload not in ``skip``; ``on_result(i, result)`` in the driver as
        each finishes (in completion order).

        Returns:
            results in payload order (``None`` for skipped shards).
        Raises:
            RuntimeError: a shard failed (the message names the shard index, op and model dir).
        """
        todo = [i for i in range(len(payloads)) if i not in skip]
        if not todo:
            return [None] * len(payloads)
        g = self._acquire(self._key(model_dir, self.batch_size))
        # the head travels with every shard (the actors may have served another head before)
        payloads = [{**p, "head_dir": str(head_dir) if head_dir else None} for p in payloads]
        try:
            return self._run_shards(g, op, payloads, todo, on_result, desc)
        finally:
            with self._lock:
                self._trim_idle(keep=g.key if self.keep_idle else None)

    def text_model(self, name: str, model_dir: str, head_dir: str | None = None,
                   batch_size: int | None = None) -> "RayTextModel":
        """A :class:`RayTextModel` proxy over the ``num_actors`` actors of ``(model_dir,
        batch_size)`` (started unless another open proxy holds them), applying ``head_dir``'s head
        on every call (None: the plain model); close it to release the actors."""
        return RayTextModel(self, name, str(model_dir), str(head_dir) if head_dir else None,
                            batch_size or self.batch_size)

    def vllm_text_model(self, name: str, model_dir: str, head_dir: str | None = None,
                        batch_size: int | None = None, *, engine_cls: type,
                        engine_kwargs: dict[str, Any]) -> "RayVLLMTextModel":
        """A :class:`RayVLLMTextModel` proxy over ``num_actors`` actors each holding one engine of
        ``model_dir`` (:class:`~darts_bench.executors.vllm_worker.VLLMWorker`), started unless
        another open proxy with the same engine settings holds them, applying ``head_dir``'s head on
        every call (None: plain); close it to release the actors.

        Args:
            engine_cls: the engine class the actors build
                (:class:`~darts_bench.evaluate.engines.vllm.VLLMEngine`, or anything with its
                constructor, ``text_model(name, head_dir, batch_size=...)`` and ``shutdown()``).
            engine_kwargs: its keyword arguments besides ``model_dir`` (``vcfg``, ``dtype``,
                ``seed``, ...); part of the group key with the class.
        """
        bs = batch_size or self.batch_size
        kwargs = dict(model_dir=str(model_dir), engine_cls=engine_cls, engine_kwargs=dict(engine_kwargs),
                      batch_size=bs)
        key = ("engine", str(model_dir), bs, f"{engine_cls.__module__}.{engine_cls.__qualname__}",
               repr(sorted(engine_kwargs.items())))
        spec = dict(worker_cls=VLLMWorker, kwargs=kwargs, graceful=True)
        return RayVLLMTextModel(self, name, str(model_dir), str(head_dir) if head_dir else None, bs,
                                key=key, spec=spec)

    def close(self) -> None:
        """Kill every actor; shut Ray down if this executor started (or connected) it."""
        with self._lock:
            for g in list(self._groups.values()):
                self._kill_group(g)
            self._closed = True
        if self._owns_ray and ray.is_initialized():
            ray.shutdown()
        self._owns_ray = False

    def __enter__(self) -> "RayExecutor":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _own(obj: Any) -> Any:
    """``obj`` with every read-only numpy array (a zero-copy view into Ray's object store) copied
    into ordinary memory: callers get writable arrays, as from the local executor, and the store
    does not stay pinned by results the driver keeps."""
    import numpy as np

    if isinstance(obj, np.ndarray):
        return obj.copy() if not obj.flags.writeable else obj
    if isinstance(obj, dict):
        return {k: _own(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_own(v) for v in obj]
    return obj


def _cause(e: BaseException) -> str:
    cause = getattr(e, "cause", None)
    if isinstance(cause, BaseException):
        return f"{type(cause).__name__}: {cause}"
    msg = str(e).strip().splitlines()
    return f"{type(e).__name__}: {msg[0] if msg else ''}"


class RayTextModel:
    """:class:`darts_bench.api.TextModel` whose calls run on a :class:`RayExecutor`'s actors.

    Prompts are cut into contiguous chunks of ``chunk_size`` (``ray.shard_size`` rounded up to a
    multiple of ``batch_size``), each sampled with the call's seed (seeds are per prompt and
    sample); results are
    concatenated in prompt order, equal to :class:`~darts_bench.evaluate.hf_model.HFTextModel`'s.
    Every call carries this proxy's ``head_dir``, which the actor puts on its loaded model first,
    so proxies of one model with different heads share the actors.
    ``format_chat`` uses the tokenizer loaded in the driver.
    """

    def __init__(self, executor: RayExecutor, name: str, model_dir: str, head_dir: str | None, batch_size: int,
                 *, key: tuple | None = None, spec: dict[str, Any] | None = None):
        self.name, self.model_dir, self.head_dir, self.batch_size = name, model_dir, head_dir, batch_size
        self._ex = executor
        shard = executor.rcfg.shard_size
        self.chunk_size = max(batch_size, -(-shard // batch_size) * batch_size)
        self._tokenizer = None
        self._closed = False
        self._key = key or executor._key(model_dir, batch_size)
        self._spec = spec
        with executor._lock:
            executor._users[self._key] += 1
        try:
            executor._acquire(self._key, name=name, spec=spec)
        except BaseException:
            self.close()
            raise

    # ------------------------------------------------------------------ plumbing
    @property
    def tokenizer(self):
        if self._tokenizer is None:
            from transformers import AutoTokenizer

            tok = AutoTokenizer.from_pretrained(self.model_dir)
            tok.padding_side = tok.truncation_side = "left"
            if tok.pad_token is None:
                tok.pad_token = tok.eos_token
            self._tokenizer = tok
        return self._tokenizer

    def _run(self, op: str, payloads: list[dict[str, Any]], desc: str) -> list[Any]:
        if self._closed:
            raise RuntimeError(f"text model {self.name!r} is closed")
        if not payloads:
            return []
        g = self._ex._acquire(self._key, name=self.name, spec=self._spec)
        payloads = [{**p, "head_dir": self.head_dir, "name": self.name} for p in payloads]  # the head of every call
        return self._ex._run_shards(g, op, payloads, list(range(len(payloads))), None, desc)

    def _spans(self, n: int) -> list[tuple[int, int]]:
        """``[start, end)`` of each chunk of ``n`` prompts, contiguous, in order."""
        return [(s, min(n, s + self.chunk_size)) for s in range(0, n, self.chunk_size)]

    # ------------------------------------------------------------------ TextModel
    def generate_ids(self, prompts: Sequence[str], *, max_new_tokens: int, stop: Sequence[str] = (),
                     num_samples: int = 1, temperature: float = 0.0, top_p: float = 1.0,
                     seed: int = 0) -> list[list[list[int]]]:
        """Generated token ids, ``[prompt][sample][token]`` (see ``HFTextModel.generate_ids``)."""
        return self._generate("generate_ids", prompts, max_new_tokens, stop, num_samples, temperature, top_p, seed)

    def generate(self, prompts: Sequence[str], *, max_new_tokens: int, stop: Sequence[str] = (),
                 num_samples: int = 1, temperature: float = 0.0, top_p: float = 1.0, seed: int = 0) -> list[list[str]]:
        """Continuations, ``[prompt][sample]`` :class:`~darts_bench.api.Completion` strings (finish
        reasons from the actors' models) cut before the first stop sequence."""
        return self._generate("generate", prompts, max_new_tokens, stop, num_samples, temperature, top_p, seed)

    def _generate(self, op, prompts, max_new_tokens, stop, num_samples, temperature, top_p, seed) -> list:
        prompts = list(prompts)
        kw = _gen_kwargs(max_new_tokens, stop, num_samples, temperature, top_p, seed)
        payloads = [{"prompts": prompts[s:e], "kwargs": kw} for s, e in self._spans(len(prompts))]
        return [row for shard in self._run(op, payloads, f"{op} {self.name}") for row in shard]

    def score(self, contexts: Sequence[str], continuations: Sequence[str]) -> list[ScoreContinuation]:
        """Per-pair log-likelihood of ``continuation`` given ``context``."""
        if len(contexts) != len(continuations):
            raise ValueError(f"{len(contexts)} contexts vs {len(continuations)} continuations")
        contexts, continuations = list(contexts), list(continuations)
        payloads = [{"contexts": contexts[s:e], "continuations": continuations[s:e]}
                    for s, e in self._spans(len(contexts))]
        return [r for shard in self._run("score", payloads, f"score {self.name}") for r in shard]

    def format_chat(self, user_message: str) -> str:
        from darts_bench.evaluate.hf_model import format_chat

        return format_chat(self.tokenizer, user_message)

    def multi_head(self, name: str, head_dirs: Sequence[str | None],
                   max_batch: int | None = None) -> "RayMultiHeadModel":
        """A :class:`RayMultiHeadModel` with one slot per entry of ``head_dirs`` (None: the plain
        model) on this proxy's actor group; it owns this proxy (closing it closes the proxy). This
        proxy must be the plain one (``head_dir`` None). ``max_batch``: the HF actors' cap on
        sequences per stacked ``generate`` (``evaluate.one_pass_max_batch``).

        Raises:
            ValueError: this proxy carries a head.
        """
        if self.head_dir is not None:
            raise ValueError(f"{self.name}: a multi-head model is made from the plain proxy, not one with head "
                             f"{self.head_dir}")
        cls = RayMultiHeadModel if isinstance(self, RayVLLMTextModel) else RayHFMultiHeadModel
        return cls(self, name, head_dirs, max_batch=max_batch)

    def close(self) -> None:
        """Release this proxy's actors (killed when no other open proxy uses the same model)."""
        if self._closed:
            return
        self._closed = True
        ex = self._ex
        with ex._lock:
            ex._users[self._key] -= 1
            if ex._users[self._key] <= 0:
                del ex._users[self._key]
                g = ex._groups.get(self._key)
                if g is not None and not g.busy:
                    ex._kill_group(g)

    def __enter__(self) -> "RayTextModel":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class RayVLLMTextModel(RayTextModel):
    """:class:`darts_bench.api.TextModel` on a group of Ray actors each holding one vLLM engine of
    ``model_dir`` (made by :meth:`RayExecutor.vllm_text_model` for the vLLM backend).

    Data parallel: the prompts of a call are split into one contiguous chunk per actor (vLLM
    batches and schedules inside each engine), every chunk with the call's seed; the engine seeds
    each sample by (seed, prompt, sample index), as one engine would.
    The head (``head_dir``, None: plain) is sent with every call and swapped into the running
    engine; the engine keeps the KV cache (the head acts after the last layer).
    """

    def _spans(self, n: int) -> list[tuple[int, int]]:
        g = self._ex._acquire(self._key, name=self.name, spec=self._spec)
        size = max(1, -(-n // max(1, len(g.actors))))
        return [(s, min(n, s + size)) for s in range(0, n, size)]

    @property
    def tokenizer(self):
        if self._tokenizer is None:
            from transformers import AutoTokenizer

            tok = AutoTokenizer.from_pretrained(self.model_dir)
            tok.truncation_side = "left"  # as VLLMEngine's
            if tok.pad_token is None:
                tok.pad_token = tok.eos_token
            self._tokenizer = tok
        return self._tokenizer


class RayMultiHeadModel:
    """Every head of one model dir on its Ray actor group, serving requests that name their slot
    (the Ray layout of ``Backend.multi_head_model``; interface of
    :class:`~darts_bench.evaluate.multi_head.HFMultiHeadModel`: ``generate`` / ``generate_ids``
    over ``(slot, prompt)`` requests, ``score`` over ``(slot, context, continuation)``, results in
    request order).

    Each slot's requests are cut into the chunks its single-head proxy would send
    (:meth:`RayTextModel._spans`: ``ray.shard_size`` rounded up to a multiple of the batch size
    for HF actors, one contiguous chunk per actor for engine actors), and chunk ``k`` of every
    slot travels in one payload (op ``multi_*``, :data:`~darts_bench.executors.worker.MULTI_OPS`),
    so an actor runs the chunks of all heads in one multi-head call: greedy outputs equal the
    row-by-row path's token for token (the same batches per head) where the one pass is exact
    (``darts_bench.stages.evaluate.one_pass_exact``), and a score request's
    (context, continuation) pair is run through the transformer once for all heads asking for it
    (distinct pairs are chunked in first-request order, as in-process).

    Args:
        proxy: the plain :class:`RayTextModel` (or :class:`RayVLLMTextModel`) of the model dir;
            owned (closed by :meth:`close`).
        name: label (progress bars, the engine's logs).
        head_dirs: one entry per slot (None: the plain model).
        max_batch: sent with every payload: the HF actors' cap on sequences per stacked
            ``generate`` (``evaluate.one_pass_max_batch``; engine actors ignore it).
    """

    def __init__(self, proxy: RayTextModel, name: str, head_dirs: Sequence[str | None], max_batch: int | None = None):
        self._proxy, self.name, self.max_batch = proxy, name, max_batch
        self.head_dirs = [str(h) if h else None for h in head_dirs]

    @property
    def n_heads(self) -> int:
        return len(self.head_dirs)

    @property
    def tokenizer(self):
        return self._proxy.tokenizer

    def format_chat(self, user_message: str) -> str:
        return self._proxy.format_chat(user_message)

    def _check(self, slots) -> None:
        bad = sorted({s for s in slots if s is not None and not 0 <= s < len(self.head_dirs)})
        if bad:
            raise ValueError(f"{self.name}: head slots {bad[:5]} out of range ({len(self.head_dirs)} slots; "
                             f"None = plain)")

    def _by_chunk(self, keys: Sequence[Any]) -> list[list[int]]:
        """Request indices per payload: for each key (slot) its requests in order, cut by the
        proxy's spans; payload ``k`` holds chunk ``k`` of every key."""
        by: dict[Any, list[int]] = {}
        for r, k in enumerate(keys):
            by.setdefault(k, []).append(r)
        parts: list[list[int]] = []
        for rs in by.values():
            for k, (s, e) in enumerate(self._proxy._spans(len(rs))):
                if k == len(parts):
                    parts.append([])
                parts[k].extend(rs[s:e])
        return parts

    def _gen(self, op: str, requests, kw: dict[str, Any]) -> list:
        requests = [(s, p) for s, p in requests]
        self._check([s for s, _ in requests])
        parts = self._by_chunk([s for s, _ in requests])
        payloads = [{"head_dirs": self.head_dirs, "requests": [requests[r] for r in rs], "kwargs": kw,
                     "max_batch": self.max_batch} for rs in parts]
        out: list = [None] * len(requests)
        for rs, res in zip(parts, self._proxy._run(op, payloads, f"{op} {self.name}")):
            for r, x in zip(rs, res):
                out[r] = x
        return out

    def generate(self, requests: Sequence[tuple[int | None, str]], *, max_new_tokens: int,
                 stop: Sequence[str] = (), num_samples: int = 1, temperature: float = 0.0, top_p: float = 1.0,
                 seed: int = 0) -> list[list[str]]:
        """``[request][sample]`` :class:`~darts_bench.api.Completion` strings (as
        :meth:`RayTextModel.generate` of the request's head), every chunk with the call's seed.

        Raises:
            ValueError: a slot out of range; greedy with ``num_samples != 1``.
            RuntimeError: a chunk failed on its actor (names the chunk, op and model dir).
        """
        return self._gen("multi_generate", requests, _gen_kwargs(max_new_tokens, stop, num_samples, temperature,
                                                                 top_p, seed))

    def generate_ids(self, requests: Sequence[tuple[int | None, Any]], *, max_new_tokens: int,
                     stop: Sequence[str] = (), num_samples: int = 1, temperature: float = 0.0, top_p: float = 1.0,
                     seed: int = 0) -> list[list[list[int]]]:
        """``[request][sample][token]``, as :meth:`generate` (prompts as text or token ids)."""
        return self._gen("multi_generate_ids", requests, _gen_kwargs(max_new_tokens, stop, num_samples,
                                                                     temperature, top_p, seed))

    def score(self, requests: Sequence[tuple[int | None, str, str]]) -> list[ScoreContinuation]:
        """Log-likelihood per ``(slot, context, continuation)`` request; the distinct pairs (first
        request order) are cut into the proxy's spans, each span's requests in one payload.

        Raises:
            ValueError: a slot out of range.
        """
        requests = [(s, c, x) for s, c, x in requests]
        self._check([s for s, _, _ in requests])
        distinct: dict[tuple[str, str], int] = {}
        for _, c, x in requests:
            distinct.setdefault((c, x), len(distinct))
        span_of = {}
        for k, (s, e) in enumerate(self._proxy._spans(len(distinct))):
            span_of.update({i: k for i in range(s, e)})
        parts: dict[int, list[int]] = {}
        for r, (_, c, x) in enumerate(requests):
            parts.setdefault(span_of[distinct[(c, x)]], []).append(r)
        order = sorted(parts)
        payloads = [{"head_dirs": self.head_dirs, "requests": [requests[r] for r in parts[k]]} for k in order]
        out: list = [None] * len(requests)
        for k, res in zip(order, self._proxy._run("multi_score", payloads, f"score {self.name}")):
            for r, x in zip(parts[k], res):
                out[r] = x
        return out

    def close(self) -> None:
        """Close the proxy (its actors are released once no other open proxy uses them)."""
        self._proxy.close()


class RayHFMultiHeadModel(RayMultiHeadModel):
    """:class:`RayMultiHeadModel` on HF actors, which also serve the plain model's prompt states
    (what a routed row's router reads) from the actors."""

    def prompt_states(self, prompts: Sequence[str]):
        """The plain model's mean-pooled prompt states ``[n, d_model]`` float32
        (``HFTextModel.prompt_states`` on the actors, chunked as :meth:`generate` chunks them)."""
        import torch

        prompts = list(prompts)
        payloads = [{"prompts": prompts[s:e]} for s, e in self._proxy._spans(len(prompts))]
        parts = self._proxy._run("prompt_states", payloads, f"prompt states {self.name}")
        return torch.cat(parts) if parts else torch.zeros(0)


def _gen_kwargs(max_new_tokens, stop, num_samples, temperature, top_p, seed) -> dict[str, Any]:
    """A generate payload's ``kwargs`` (``top_p`` only below 1).

    Raises:
        ValueError: greedy (temperature 0) with ``num_samples != 1``.
    """
    if temperature == 0.0 and num_samples != 1:
        raise ValueError("greedy decoding (temperature 0) gives one sample; set temperature > 0")
    kw = dict(max_new_tokens=max_new_tokens, stop=list(stop), num_samples=num_samples, temperature=temperature,
              seed=seed)
    if top_p != 1.0:
        kw["top_p"] = top_p
    return kw


# --------------------------------------------------------------------- stopping a head by pid
def head_processes(temp_dir: str, port: int, host: str = "127.0.0.1") -> list:
    """The processes of a head started with ``ray start --head --temp-dir TEMP_DIR --port PORT``:
    its daemons (their command lines name the temp dir or the GCS address) and all their
    descendants (agents and workers, whose command lines Ray rewrites), as ``psutil.Process``es."""
    import re

    import psutil

    pat = re.compile(re.escape(str(temp_dir).rstrip("/")) + r"(/|\s|$)|" + re.escape(f"{host}:{port}") + r"(?!\d)")
    found: dict[int, Any] = {}
    for p in psutil.process_iter(["cmdline"]):
        try:
            if p.pid != os.getpid() and pat.search(" ".join(p.info["cmdline"] or [])):
                found[p.pid] = p
                for c in p.children(recursive=True):
                    found[c.pid] = c
        except psutil.Error:
            continue
    return [p for pid, p in sorted(found.items()) if pid != os.getpid()]


def stop_head(temp_dir: str, port: int, host: str = "127.0.0.1", timeout: float = 10.0) -> list[int]:
    """Stop one head node (and its workers) by pid: SIGTERM, then SIGKILL after ``timeout`` s.

    The alternative to ``ray stop``, which stops every Ray process on the machine, other users'
    included. Returns the pids that were signalled.
    """
    import psutil

    signalled: set[int] = set()
    for _ in range(3):  # agents orphaned by a dying raylet are found on the next pass
        procs = [p for p in head_processes(temp_dir, port, host) if p.pid not in signalled]
        if not procs:
            break
        for p in procs:
            with contextlib.suppress(psutil.Error):
                p.terminate()
            signalled.add(p.pid)
        _, alive = psutil.wait_procs(procs, timeout=timeout)
        for p in alive:
            with contextlib.suppress(psutil.Error):
                p.kill()
        psutil.wait_procs(alive, timeout=5)
    return sorted(signalled)


def _main(argv: list[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(prog="python -m darts_bench.executors.ray_executor",
                                 description="Stop one Ray head (started with its own --temp-dir) by pid.")
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("stop-head", help="SIGTERM, then SIGKILL, the head's processes and their workers")
    s.add_argument("--temp-dir", required=True, help="the head's --temp-dir")
    s.add_argument("--port", type=int, required=True, help="the head's GCS --port")
    s.add_argument("--host", default="127.0.0.1", help="the head's --node-ip-address")
    s.add_argument("--dry-run", action="store_true", help="list the processes, stop nothing")
    args = ap.parse_args(argv)
    if args.dry_run:
        for p in head_processes(args.temp_dir, args.port, args.host):
            with contextlib.suppress(Exception):
                print(p.pid, " ".join(p.cmdline())[:120] or p.name())
        return 0
    pids = stop_head(args.temp_dir, args.port, args.host)
    print(f"stopped {len(pids)} processes: {' '.join(map(str, pids))}" if pids else "no process of that head found")
    return 0


if __name__ == "__main__":
    raise SystemExit(_main())
