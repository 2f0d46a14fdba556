"""Real redis-server processes for the fleet tier's tests and benchmark: one Redis, or a Redis Cluster
made with `redis-cli --cluster create`. Debian's redis-server (`make test` installs it)."""

from __future__ import annotations

import random
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

from harness.servers import free_port

READY_TIMEOUT_S = 20.0


def available() -> str | None:
    """Why Redis cannot run here, or None."""
    missing = [name for name in ("redis-server", "redis-cli") if shutil.which(name) is None]
    return f"{' and '.join(missing)} not installed (make test installs them: apt-get install redis-server)" \
        if missing else None


def cli(port: int, *args: str, timeout: float = 10.0) -> str:
    done = subprocess.run(["redis-cli", "-p", str(port), *args], capture_output=True, text=True, timeout=timeout)
    return done.stdout.strip()


def cluster_port() -> int:
    """A free port whose cluster bus port (+10000) is free too; cluster nodes need a port <= 55535."""
    while True:
        port = random.randint(20000, 55535)
        try:
            with socket.socket() as one, socket.socket() as bus:
                one.bind(("127.0.0.1", port))
                bus.bind(("127.0.0.1", port + 10000))
        except OSError:
            continue
        return port


class RedisProcess:
    """One redis-server on a free port, no persistence; `kill` (SIGKILL) and `start` again on the same port."""

    def __init__(self, workdir: Path, *, cluster: bool = False, node_timeout_ms: int = 1000) -> None:
        self.port = cluster_port() if cluster else free_port()
        self.dir = workdir / f"redis-{self.port}"
        self.dir.mkdir(parents=True)
        self.args = ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                     "--appendonly", "no", "--dir", str(self.dir), "--daemonize", "no"]
        if cluster:
            # validity factor 0: a replica may always take over (else one that synced moments ago
            # counts as too stale, and a failover in the first seconds of a test never happens)
            self.args += ["--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
                          "--cluster-node-timeout", str(node_timeout_ms), "--cluster-replica-validity-factor", "0"]
        self.proc: subprocess.Popen | None = None
        self.start()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}"

    def start(self) -> None:
        log = open(self.dir / "redis.log", "a")
        self.proc = subprocess.Popen(self.args, cwd=self.dir, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + READY_TIMEOUT_S
        while cli(self.port, "ping") != "PONG":
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"redis-server on {self.port} did not start:\n{(self.dir / 'redis.log').read_text()}")
            time.sleep(0.02)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.kill()


class RedisCluster:
    """`masters` masters with `replicas` replicas each, on free ports of this host."""

    def __init__(self, workdir: Path, masters: int = 3, replicas: int = 1, node_timeout_ms: int = 1000) -> None:
        self.nodes = [RedisProcess(workdir, cluster=True, node_timeout_ms=node_timeout_ms)
                      for _ in range(masters * (1 + replicas))]
        try:
            created = subprocess.run(
                ["redis-cli", "--cluster", "create", *(f"127.0.0.1:{n.port}" for n in self.nodes),
                 "--cluster-replicas", str(replicas), "--cluster-yes"],
                capture_output=True, text=True, timeout=60)
            if created.returncode != 0:
                raise RuntimeError(f"redis-cli --cluster create failed:\n{created.stdout}\n{created.stderr}")
            self.wait_ok()
            self._wait_replicas_synced()
        except BaseException:
            self.stop()
            raise

    @property
    def url(self) -> str:
        return "redis-cluster://" + ",".join(f"127.0.0.1:{n.port}" for n in self.nodes)

    def live(self) -> list[RedisProcess]:
        return [n for n in self.nodes if n.proc is not None and n.proc.poll() is None]

    def masters(self) -> list[RedisProcess]:
        """The live nodes that serve slots now (as a live node reports the cluster)."""
        by_port = {n.port: n for n in self.live()}
        ports = set()
        for line in cli(next(iter(by_port)), "cluster", "nodes").splitlines():
            parts = line.split()
            if "master" in parts[2] and "fail" not in parts[2] and len(parts) > 8:
                ports.add(int(parts[1].split("@")[0].rsplit(":", 1)[1]))
        return [by_port[p] for p in sorted(ports) if p in by_port]

    def wait_ok(self, timeout: float = 30.0) -> None:
        """Until every live node says cluster_state:ok and the slots are all served."""
        deadline = time.monotonic() + timeout
        while True:
            states = [cli(n.port, "cluster", "info") for n in self.live()]
            if all("cluster_state:ok" in s and "cluster_slots_ok:16384" in s for s in states):
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"cluster not ok after {timeout} s: {states[:1]}")
            time.sleep(0.1)

    def _wait_replicas_synced(self, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        for node in self.nodes:
            while True:
                info = cli(node.port, "info", "replication")
                if "role:master" in info or "master_link_status:up" in info:
                    break
                if time.monotonic() > deadline:
                    raise TimeoutError(f"replica {node.port} not in sync after {timeout} s")
                time.sleep(0.05)

    def kill_master(self) -> RedisProcess:
        """kill -9 one master, then wait until a replica has taken its slots over."""
        victim = self.masters()[0]
        victim.kill()
        deadline = time.monotonic() + 30
        witness = self.live()[0].port
        while f"127.0.0.1:{victim.port}" not in "".join(
                line for line in cli(witness, "cluster", "nodes").splitlines() if "fail" in line.split()[2]):
            if time.monotonic() > deadline:
                raise TimeoutError("the cluster did not notice the dead master")
            time.sleep(0.05)
        self.wait_ok()
        return victim

    def reshard(self, slots: int) -> None:
        """Moves `slots` slots (and their keys, by MIGRATE) from the first master to the second."""
        source, target = self.masters()[:2]
        moved = subprocess.run(
            ["redis-cli", "--cluster", "reshard", f"127.0.0.1:{source.port}",
             "--cluster-from", cli(source.port, "cluster", "myid"), "--cluster-to", cli(target.port, "cluster", "myid"),
             "--cluster-slots", str(slots), "--cluster-yes"], capture_output=True, text=True, timeout=120)
        if moved.returncode != 0:
            raise RuntimeError(f"redis-cli --cluster reshard failed:\n{moved.stdout[-2000:]}\n{moved.stderr}")
        self.wait_ok()

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()
