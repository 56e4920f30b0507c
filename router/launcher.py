"""``pdserve up``: Redis, the router and N prefill + M decode workers as separate processes.

``Cluster`` is also what the end-to-end tests and ``pdserve bench serve`` use, so they run the
same processes a user does. Readiness is the standard gRPC health check of each service.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from router.redis_server import RedisServer, free_port


@dataclass
class ClusterSpec:
    model: str = "tiny-llama"
    num_prefill: int = 1
    num_decode: int = 1
    prefill_tp: int = 1
    redis_url: str | None = None
    router_port: int = 0
    namespace: str = "pdserve"
    kv_transfer_backend: str = "nixl"
    # Extra engine flags for every worker, e.g. ["--num-gpu-blocks", "256"].
    worker_args: list[str] = field(default_factory=list)
    router_args: list[str] = field(default_factory=list)
    start_timeout_s: float = 180.0
    # CPU threads per worker rank (OMP_NUM_THREADS); None shares this host's cores out among
    # the ranks the spec starts, since every worker busy on all cores at once oversubscribes
    # them. An OMP_NUM_THREADS already in the environment wins.
    threads_per_rank: int | None = None

    def __post_init__(self) -> None:
        if self.num_prefill < 1 or self.num_decode < 1:
            raise ValueError("a cluster needs at least one prefill and one decode worker")
        if self.threads_per_rank is not None and self.threads_per_rank < 1:
            raise ValueError(f"threads_per_rank must be >= 1, got {self.threads_per_rank}")

    def worker_env(self) -> dict[str, str]:
        env = dict(os.environ)
        if "OMP_NUM_THREADS" not in env:
            ranks = self.num_prefill * self.prefill_tp + self.num_decode
            per = self.threads_per_rank or max(1, (os.cpu_count() or 1) // ranks)
            env["OMP_NUM_THREADS"] = str(per)
        return env


@dataclass
class Proc:
    name: str
    address: str
    popen: subprocess.Popen


class Cluster:
    def __init__(self, spec: ClusterSpec) -> None:
        self.spec = spec
        self.redis: RedisServer | None = None
        self.redis_url = spec.redis_url
        self.procs: list[Proc] = []
        self.router_address = ""

    # --- start ----------------------------------------------------------------------------
    def start(self) -> Cluster:
        try:
            if self.redis_url is None:
                self.redis = RedisServer()
                self.redis_url = self.redis.url
            for _ in range(self.spec.num_prefill):
                self.add_worker("prefill", wait=False)
            for _ in range(self.spec.num_decode):
                self.add_worker("decode", wait=False)
            port = self.spec.router_port or free_port()
            self.router_address = f"127.0.0.1:{port}"
            self._spawn("router", self.router_address, [
                "router", "--model", self.spec.model, "--port", str(port),
                "--redis-url", self.redis_url, "--namespace", self.spec.namespace,
                *self.spec.router_args])
            for p in self.procs:
                self._wait_healthy(p)
            self.wait_routable(self.spec.num_prefill, self.spec.num_decode)
        except BaseException:
            self.stop()
            raise
        return self

    def add_worker(self, role: str, wait: bool = True, extra: list[str] | None = None) -> Proc:
        port = free_port()
        address = f"127.0.0.1:{port}"
        args = [role, "--model", self.spec.model, "--port", str(port), "--redis-url",
                self.redis_url, "--namespace", self.spec.namespace,
                "--kv-transfer-backend", self.spec.kv_transfer_backend,
                "--worker-id", f"{role}-{port}", *self.spec.worker_args, *(extra or [])]
        if role == "prefill" and self.spec.prefill_tp > 1:
            args += ["--tensor-parallel-size", str(self.spec.prefill_tp)]
        proc = self._spawn(f"{role}-{port}", address, args, self.spec.worker_env())
        if wait:
            self._wait_healthy(proc)
        return proc

    def _spawn(self, name: str, address: str, args: list[str],
               env: dict[str, str] | None = None) -> Proc:
        popen = subprocess.Popen([sys.executable, "-m", "engine.cli", *args], env=env)
        proc = Proc(name, address, popen)
        self.procs.append(proc)
        return proc

    def _wait_healthy(self, proc: Proc) -> None:
        deadline = time.monotonic() + self.spec.start_timeout_s
        with grpc.insecure_channel(proc.address) as ch:
            stub = health_pb2_grpc.HealthStub(ch)
            while True:
                if proc.popen.poll() is not None:
                    raise RuntimeError(f"{proc.name} exited with {proc.popen.returncode} "
                                       "while starting")
                try:
                    resp = stub.Check(health_pb2.HealthCheckRequest(), timeout=1.0)
                    if resp.status == health_pb2.HealthCheckResponse.SERVING:
                        return
                except grpc.RpcError:
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{proc.name} not healthy after "
                                       f"{self.spec.start_timeout_s:.0f}s")
                time.sleep(0.2)

    def wait_routable(self, num_prefill: int, num_decode: int, timeout_s: float = 30.0) -> None:
        """Until the router's registry view has exactly these many live workers."""
        from protos import router_pb2, router_pb2_grpc

        deadline = time.monotonic() + timeout_s
        with grpc.insecure_channel(self.router_address) as ch:
            stub = router_pb2_grpc.RouterAdminStub(ch)
            while True:
                s = stub.GetClusterStats(router_pb2.ClusterStatsRequest(), timeout=5.0)
                if (s.num_prefill_workers, s.num_decode_workers) == (num_prefill, num_decode):
                    return
                if time.monotonic() > deadline:
                    raise RuntimeError(f"router sees {s.num_prefill_workers} prefill and "
                                       f"{s.num_decode_workers} decode workers, expected "
                                       f"{num_prefill} and {num_decode}")
                time.sleep(0.1)

    # --- stop -----------------------------------------------------------------------------
    def stop_proc(self, proc: Proc, grace_s: float = 30.0) -> int:
        """SIGTERM (drain, then stop), SIGKILL after the grace period; the exit code."""
        if proc.popen.poll() is None:
            proc.popen.send_signal(signal.SIGTERM)
            try:
                proc.popen.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                # Stuck in its shutdown: its thread stacks (SIGUSR1, see grpc_server.run) on
                # its stderr say where, before the kill.
                proc.popen.send_signal(signal.SIGUSR1)
                time.sleep(1.0)
                proc.popen.kill()
                proc.popen.wait()
        if proc in self.procs:
            self.procs.remove(proc)
        return proc.popen.returncode

    def stop(self) -> None:
        # The router first, so no new work reaches workers that are going away.
        for proc in sorted(self.procs, key=lambda p: p.name != "router"):
            if proc.popen.poll() is None:
                proc.popen.send_signal(signal.SIGTERM)
        for proc in list(self.procs):
            self.stop_proc(proc)
        if self.redis is not None:
            self.redis.stop()
            self.redis = None

    def __enter__(self) -> Cluster:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
