"""A two-node Ray cluster on loopback for the tests (tests/test_ray_cluster.py): a head on 127.0.0.2
and a second node on 127.0.0.3, each a ``ray start --block`` process with every port pinned and a
``--temp-dir`` of its own, token auth off (``RAY_AUTH_MODE=disabled`` for the nodes and every
client, as ray_configs/README.md says for a machine nobody else reaches). Ray rewrites 127.0.0.1
to the machine's routable address, not 127.0.0.2/3 (LAB-NOTES "A one-node SLURM and a two-node Ray").

Everything is stopped by pid: SIGTERM to a node's ``ray start --block`` process (which cleans its node
up), then SIGKILL to whatever of its process tree is left. Never ``ray stop``.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil

VENV_BIN = Path(sys.executable).parent
HEAD_IP, NODE_IP = "127.0.0.2", "127.0.0.3"
LABEL = "node_b"  # the second node's custom resource: ray.actor_nodes pins actor slots to it


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def ray_env(**extra: str) -> dict[str, str]:
    """The environment of every node and client: auth off, no usage stats, the venv first on PATH."""
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0",
           "PATH": f"{VENV_BIN}{os.pathsep}{os.environ['PATH']}"}
    env.pop("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", None)  # that switch turns multi-node clusters off
    env.pop("RAY_ADDRESS", None)
    env.update(extra)
    return env


@dataclass
class Node:
    ip: str
    temp_dir: Path
    proc: subprocess.Popen
    log: Path
    pids: set[int] = field(default_factory=set)

    def tree(self) -> list[psutil.Process]:
        """The node's live processes: the ``ray start --block`` process and all its descendants."""
        try:
            root = psutil.Process(self.proc.pid)
            procs = [root] + root.children(recursive=True)
        except psutil.NoSuchProcess:
            procs = []
        self.pids |= {p.pid for p in procs}
        return procs

    def raylet(self) -> psutil.Process:
        return next(p for p in self.tree() if p.name() == "raylet")


def _ports(ip: str) -> list[str]:
    return ["--node-manager-port", str(free_port(ip)), "--object-manager-port", str(free_port(ip)),
            "--metrics-export-port", str(free_port(ip)), "--runtime-env-agent-port", str(free_port(ip)),
            "--dashboard-agent-listen-port", str(free_port(ip)), "--dashboard-agent-grpc-port", str(free_port(ip))]


@dataclass
class Cluster:
    root: Path
    gcs_port: int
    dash_port: int
    head: Node | None = None
    second: Node | None = None
    started: list[Node] = field(default_factory=list)

    @property
    def address(self) -> str:
        return f"{HEAD_IP}:{self.gcs_port}"

    @property
    def dashboard(self) -> str:
        return f"http://{HEAD_IP}:{self.dash_port}"

    # ------------------------------------------------------------------ start
    def start_head(self, num_cpus: int = 2, env: dict[str, str] | None = None) -> Node:
        temp = Path(tempfile.mkdtemp(prefix="h-", dir=self.root))
        # fast node-death detection (defaults: ~12 s): the lost-node test measures the recovery
        health = {"RAY_health_check_period_ms": "500", "RAY_health_check_timeout_ms": "500",
                  "RAY_health_check_failure_threshold": "3", "RAY_health_check_initial_delay_ms": "0"}
        cmd = [str(VENV_BIN / "ray"), "start", "--head", "--block", "--node-ip-address", HEAD_IP,
               "--port", str(self.gcs_port), "--include-dashboard=true", "--dashboard-host", HEAD_IP,
               "--dashboard-port", str(self.dash_port), "--ray-client-server-port", str(free_port(HEAD_IP)),
               "--num-cpus", str(num_cpus), "--resources", json.dumps({"node_head": 1}),
               "--temp-dir", str(temp), "--disable-usage-stats", *_ports(HEAD_IP)]
        self.head = self._start(HEAD_IP, temp, cmd, {**health, **(env or {})})
        self._wait_nodes(1)
        return self.head

    def start_second(self, num_cpus: int = 2, hide: Path | None = None, env: dict[str, str] | None = None) -> Node:
        """The second node, labelled :data:`LABEL`; ``hide``: a dir the node's processes must not see (the node
        runs in a mount namespace of its own with an empty tmpfs over it: ``unshare -m``)."""
        temp = Path(tempfile.mkdtemp(prefix="n-", dir=self.root))
        cmd = [str(VENV_BIN / "ray"), "start", "--block", "--address", self.address, "--node-ip-address", NODE_IP,
               "--num-cpus", str(num_cpus), "--resources", json.dumps({LABEL: 1}), "--temp-dir", str(temp),
               "--disable-usage-stats", *_ports(NODE_IP)]
        if hide is not None:
            import shlex

            cmd = ["unshare", "-m", "--propagation", "private", "sh", "-c",
                   f"mount -t tmpfs none {shlex.quote(str(hide))} && exec " + " ".join(map(shlex.quote, cmd))]
        n_before = len(self.alive())
        self.second = self._start(NODE_IP, temp, cmd, env or {})
        self._wait_nodes(n_before + 1)
        return self.second

    def _start(self, ip: str, temp: Path, cmd: list[str], env: dict[str, str]) -> Node:
        log = temp / "start.log"
        with open(log, "w") as f:
            proc = subprocess.Popen(cmd, env=ray_env(**env), stdout=f, stderr=subprocess.STDOUT,
                                    start_new_session=True)
        node = Node(ip, temp, proc, log)
        self.started.append(node)
        return node

    def alive(self) -> list[dict]:
        """Alive nodes as ``ray list nodes`` would report them (asked of the GCS through the CLI-free state API)."""
        r = subprocess.run([str(VENV_BIN / "python"), "-c",
                            "import json, ray; ray.init(address='%s', log_to_driver=False); "
                            "print(json.dumps([dict(ip=n['NodeManagerAddress'], id=n['NodeID']) "
                            "for n in ray.nodes() if n['Alive']]))" % self.address],
                           env=ray_env(), capture_output=True, text=True, timeout=120)
        if r.returncode != 0:
            return []
        return json.loads(r.stdout.strip().splitlines()[-1])

    def _wait_nodes(self, n: int, timeout: float = 120.0) -> None:
        deadline = time.time() + timeout
        while time.time() < deadline:
            for node in self.started:
                if node.proc.poll() is not None and node in (self.head, self.second):
                    raise RuntimeError(f"ray start on {node.ip} exited {node.proc.returncode}: "
                                       f"{node.log.read_text()[-3000:]}")
            if len(self.alive()) >= n:
                return
            time.sleep(1)
        raise TimeoutError(f"{n} Ray nodes not alive after {timeout} s")

    # ------------------------------------------------------------------ stop
    def kill_second(self) -> list[int]:
        """SIGKILL the second node's raylet and its workers (what a lost machine looks like); returns the pids."""
        node = self.second
        raylet = node.raylet()
        victims = [raylet] + raylet.children(recursive=True)
        for p in victims:
            try:
                p.send_signal(signal.SIGKILL)
            except psutil.NoSuchProcess:
                pass
        psutil.wait_procs(victims, timeout=10)
        return [p.pid for p in victims]

    def stop_node(self, node: Node, timeout: float = 15.0) -> set[int]:
        """SIGTERM the node's ``ray start --block`` process, SIGKILL its tree's leftovers; the pids left alive."""
        procs = node.tree()
        if node.proc.poll() is None:
            node.proc.send_signal(signal.SIGTERM)
        try:
            node.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            node.proc.kill()
            node.proc.wait(timeout=5)
        _, alive = psutil.wait_procs([p for p in procs if p.pid != node.proc.pid], timeout=5)
        for p in alive:
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
        psutil.wait_procs(alive, timeout=5)
        return {pid for pid in node.pids if pid_alive(pid)}

    def stop(self) -> set[int]:
        left: set[int] = set()
        for node in reversed(self.started):  # workers' nodes first, the head last
            left |= self.stop_node(node)
        shutil.rmtree(self.root, ignore_errors=True)
        return left


def pid_alive(pid: int) -> bool:
    """True while ``pid`` runs (a zombie counts as gone: LAB-NOTES, check /proc state, not kill -0)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def new_cluster() -> Cluster:
    root = Path(tempfile.mkdtemp(prefix="c2-", dir="/tmp"))  # short: Ray's socket paths must fit in 107 bytes
    return Cluster(root=root, gcs_port=free_port(HEAD_IP), dash_port=free_port(HEAD_IP))
