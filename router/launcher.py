"""``pdserve up``: Redis, the router and N prefill + M decode workers as separate processes.

With no prefill worker (``num_prefill=0``) the cluster is aggregated: the router sends every
prompt to a decode worker, which prefills it in its own steps (the local prefill of
router/local_prefill.py, with no length limit but the model's). The same router, SDK and
decode workers serve, so it is also the baseline that tells what disaggregation itself costs.

What a cluster is made of, and each worker's defaults, is ``ClusterSpec``
(router/cluster_spec.py). ``Cluster`` is also what the end-to-end tests and ``pdserve bench
serve`` use, so they run the same processes a user does. Readiness is the standard gRPC health check of each service.

Ports: a service whose port the launcher chooses binds port 0 itself and writes the address it
got to a pipe (``--ready-fd``) once serving. A port picked here and bound there later could be
taken in between, by another service or another program (and gRPC would even share it
silently). A port the user passed is used as given, never changed.

Stop: SIGTERM, and the service stops itself in bounded time (drain, the gRPC stop grace, the
engine's shutdown); a process still alive after the grace dumps its stacks and is killed, with
every process it started: a TP worker its rank 0 could not stop must not outlive it. A launcher
that dies without stopping them (SIGKILL, the OOM killer) leaves no service behind: each holds
the read end of a pipe only the launcher writes to (``--parent-fd``), and stops as on SIGTERM
at its end of file.
"""
from __future__ import annotations

import io
import os
import select
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from engine.grpc_server import ServerConfig, worst_case_stop_s
# ClusterSpec, DRAIN_TIMEOUT_S and cuda_device_count are re-exported: callers import them here.
from router.cluster_spec import DRAIN_TIMEOUT_S, ClusterSpec, flag_value, tp_size
from router.cluster_spec import cuda_device_count  # noqa: F401
from router.gpu_placement import DEFAULT_GPU_MEMORY_UTILIZATION, GpuPlan, WorkerGpus
from router.proc_family import kill_family, pin_family
from router import log_dirs, share_dirs
from router.redis_server import RedisServer
from router.stderr_tail import StderrTail


def stop_grace_s(drain_timeout_s: float) -> float:
    """How long a stopped service may take before it is killed: its own worst case with that
    drain (engine.grpc_server.worst_case_stop_s: 52 s at 10 s; 30 s cut a stop that Redis or a
    wedged engine slowed, leaving its leases and registry entries behind), and a little more."""
    return worst_case_stop_s(drain_timeout_s, ServerConfig.grace_s) + 5.0


STOP_GRACE_S = stop_grace_s(DRAIN_TIMEOUT_S)


@dataclass
class Proc:
    # "{port}" in a name stands for the port until the service reports it.
    name: str
    address: str  # "" until the service reported it
    popen: subprocess.Popen
    # The read end of the service's --ready-fd pipe, until it reported its address.
    ready: io.BufferedReader | None = field(default=None, repr=False)
    # pidfds of the processes it started (its TP workers), pinned when it is stopped.
    family: list[int] | None = field(default=None, repr=False)
    # How it was started (the name before "{port}" became the port): how to start it again.
    template: str = ""
    args: list[str] = field(default_factory=list, repr=False)
    env: dict[str, str] | None = field(default=None, repr=False)
    gpus: WorkerGpus | None = None  # a worker's GPUs, where the cluster placed it on some
    # Its stderr (a file in the cluster's log_dir), passed on to ours; its last lines say why
    # it exited (router/stderr_tail.py).
    tail: StderrTail | None = field(default=None, repr=False)

    def last_words(self, wait_s: float = 2.0) -> str:
        """": " and its last stderr lines ("" if none), for a message about its exit;
        waits up to ``wait_s`` for what it wrote last to come through."""
        lines = self.tail.last_lines(wait_s=wait_s) if self.tail is not None else []
        return f": {' | '.join(lines)}" if lines else ""

    @property
    def label(self) -> str:
        """The name, or before the service reported its port, its role and pid (messages)."""
        if "{port}" not in self.name:
            return self.name
        return f"the {self.role} worker (pid {self.popen.pid})"

    @property
    def role(self) -> str:
        """"router", "prefill" or "decode"."""
        return self.template.partition("-")[0]


class Cluster:
    def __init__(self, spec: ClusterSpec) -> None:
        self.spec = spec
        self.redis: RedisServer | None = None
        self.redis_url = spec.redis_url
        self.procs: list[Proc] = []
        self.router_address = ""
        # The folder of the workers' core-share file, made with the first worker.
        self._share_dir: str | None = None
        # The folder of the services' stderr files (router/stderr_tail.py), made with the
        # first service and removed at the stop; a killed launcher leaves it, with the
        # services' last lines.
        self.log_dir: str | None = None
        self._num_spawned = 0
        self._num_routers = 0
        # Every service gets the read end (--parent-fd); only this process holds the write
        # end, so when it dies, however, the services read end of file and stop.
        self._lifeline: tuple[int, int] | None = None
        self.gpu_plan: GpuPlan | None = None
        self._gpu_slots: list[WorkerGpus] = []  # the plan's places no worker took yet

    # --- start ----------------------------------------------------------------------------
    def start(self, should_abort: Callable[[], bool] | None = None) -> Cluster:
        """Starts every service and waits until the router sees all workers. ``should_abort``:
        polled while waiting; once true, what started is stopped and StartAborted raised."""
        if self.procs:  # e.g. `with Cluster(spec).start()`: a second, competing set of services
            raise RuntimeError("this cluster is already started: use `with Cluster(spec)` or "
                               "`Cluster(spec).start()`, not both")
        self.gpu_plan = self.spec.gpu_plan()  # a plan the GPUs cannot hold fails here
        self._gpu_slots = list(self.gpu_plan.workers) if self.gpu_plan else []
        try:
            if self.redis_url is None:
                self.redis = RedisServer(exit_with_parent=True)
                self.redis_url = self.redis.url
            for _ in range(self.spec.num_prefill):
                self.add_worker("prefill", wait=False)
            for _ in range(self.spec.num_decode):
                self.add_worker("decode", wait=False)
            self.start_router(wait=False)
            for p in self.procs:
                self._wait_healthy(p, should_abort)
            self.wait_routable(self.spec.num_prefill, self.spec.num_decode,
                               should_abort=should_abort)
        except BaseException:
            self.stop()
            raise
        return self

    def start_router(self, wait: bool = True, extra: list[str] | None = None) -> Proc:
        """The router on ``spec.router_port``, or on a port it binds itself when that is 0;
        ``extra`` flags after the spec's. Its id stays with it when it is respawned, so the
        new one releases the KV leases the dead one left (router/router_presence.py)."""
        port = self.spec.router_port
        self._num_routers += 1
        proc = self._spawn("router", [
            "router", "--model", self.spec.model, "--port", str(port),
            "--router-id", f"router-{socket.gethostname()}-{os.getpid()}-{self._num_routers}",
            "--redis-url", self.redis_url, "--namespace", self.spec.namespace,
            "--drain-timeout-s", str(self.spec.drain_timeout_s), *self.spec.router_flags(),
            *(extra or [])], self.spec.router_env())
        if wait:
            self._wait_healthy(proc)
        return proc

    def add_worker(self, role: str, wait: bool = True, extra: list[str] | None = None) -> Proc:
        """A worker on a port it binds itself; named and identified "<role>-<port>"."""
        args = [role, "--model", self.spec.model, "--port", "0", "--redis-url",
                self.redis_url, "--namespace", self.spec.namespace,
                "--kv-transfer-backend", self.spec.kv_transfer_backend,
                "--worker-id", f"{role}-{{port}}",
                "--drain-timeout-s", str(self.spec.drain_timeout_s),
                *self.spec.engine_args(role, extra or [])]
        if self.spec.cores_shared and tp_size(args) == 1:  # TP ranks keep their own threads
            if self._share_dir is None:
                self._share_dir = share_dirs.make()
            args += ["--core-share", os.path.join(self._share_dir, share_dirs.SHARE_FILE)]
        env = self.spec.worker_env()
        gpus = self._place(role, tp_size(args))
        if gpus is not None:
            env["CUDA_VISIBLE_DEVICES"] = gpus.visible_devices
            if self.gpu_plan.split_memory:
                args += ["--gpu-memory-utilization", f"{gpus.gpu_memory_utilization:.4g}"]
        if self._engine_process(gpus, tp_size(args)) and "--engine-process" not in args:
            args.append("--engine-process")
        proc = self._spawn(f"{role}-{{port}}", args, env)
        if gpus is not None:
            proc.gpus = gpus
        if wait:
            self._wait_healthy(proc)
        return proc

    def _engine_process(self, gpus: WorkerGpus | None, tp: int) -> bool:
        if self.spec.engine_process is not None:
            return self.spec.engine_process
        return gpus is not None and tp == 1

    def _place(self, role: str, tp: int) -> WorkerGpus | None:
        """The GPUs of a new ``role`` worker: its place in the plan, or for one added to the
        running cluster the least used GPUs."""
        if self.gpu_plan is None:
            return None
        for slot in self._gpu_slots:
            if slot.role == role:
                self._gpu_slots.remove(slot)
                return slot
        util = self.spec.gpu_memory_utilization or DEFAULT_GPU_MEMORY_UTILIZATION
        return self.gpu_plan.next_for(role, tp, util)

    def _spawn(self, name: str, args: list[str], env: dict[str, str] | None = None) -> Proc:
        if self._lifeline is None:
            self._lifeline = os.pipe()
        parent_fd = self._lifeline[0]
        # Made again if gone: a /tmp cleaner that removed it would fail every later restart.
        if self.log_dir is None or not os.path.isdir(self.log_dir):
            if self.log_dir is not None:
                log_dirs.remove(self.log_dir)  # forgotten, not to be removed at exit
            self.log_dir = log_dirs.make()
        self._num_spawned += 1
        tail = StderrTail(os.path.join(self.log_dir, f"{name.partition('-')[0]}-"
                                                     f"{self._num_spawned}.log"))
        read_fd, write_fd = os.pipe()  # after the tail: its failure leaks no pipe
        popen = None
        try:
            # A session of its own: a terminal's Ctrl-C reaches the launcher alone, which stops
            # the services in order (routers drained first); the lifeline pipe still ends them
            # if the launcher dies.
            popen = subprocess.Popen(
                [sys.executable, "-m", "engine.cli", *args, "--ready-fd", str(write_fd),
                 "--parent-fd", str(parent_fd)],
                env=env, pass_fds=(write_fd, parent_fd), stderr=tail.write_fd,
                start_new_session=True)
        except BaseException:
            os.close(read_fd)
            tail.close()
            raise
        finally:
            os.close(write_fd)  # the service holds the only write end: EOF once it is gone
            if popen is not None:
                tail.started(popen)
        proc = Proc(name, "", popen, ready=os.fdopen(read_fd, "rb"), template=name, args=args,
                    env=env, tail=tail)
        self.procs.append(proc)
        return proc

    def respawn(self, proc: Proc, should_abort: Callable[[], bool] | None = None) -> Proc:
        """A service that died, started again as it was first started, once healthy: a worker
        on a new port, so under a new name; the router on the port it had, so clients keep its
        address. What the dead one left behind is killed first. ``should_abort`` returning
        True (a stop asked meanwhile) ends the wait: the new service is stopped again and
        StartAborted raised."""
        self.stop_proc(proc)
        args = list(proc.args)
        if proc.role == "router" and proc.address:
            args[args.index("--port") + 1] = proc.address.rpartition(":")[2]
        new = self._spawn(proc.template, args, proc.env)
        new.gpus = proc.gpus
        if new.gpus is not None and self.gpu_plan is not None:
            self.gpu_plan.workers.append(new.gpus)  # its old place, given up by stop_proc
        try:
            self._wait_healthy(new, should_abort)
        except BaseException:
            self.stop_proc(new)
            raise
        return new

    def _wait_healthy(self, proc: Proc, should_abort: Callable[[], bool] | None = None) -> None:
        deadline = time.monotonic() + self.spec.start_timeout_s
        if proc.ready is not None:
            self._wait_address(proc, deadline, should_abort)
        with _channel(proc.args, proc.address) as ch:
            stub = health_pb2_grpc.HealthStub(ch)
            while True:
                _check_abort(proc, should_abort)
                if proc.popen.poll() is not None:
                    raise StartExited(f"{proc.label} exited with {proc.popen.returncode} "
                                      f"while starting{proc.last_words()}")
                last = "no answer"
                try:
                    resp = stub.Check(health_pb2.HealthCheckRequest(), timeout=1.0)
                    if resp.status == health_pb2.HealthCheckResponse.SERVING:
                        return
                    last = health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)
                except grpc.RpcError as e:
                    last = f"{e.code().name}: {e.details()}"
                if time.monotonic() > deadline:
                    # The last answer says why (a TLS failure reads as UNAVAILABLE here).
                    raise RuntimeError(f"{proc.label} not healthy after "
                                       f"{self.spec.start_timeout_s:.0f}s (last: {last})")
                time.sleep(0.2)

    def _wait_address(self, proc: Proc, deadline: float,
                      should_abort: Callable[[], bool] | None = None) -> None:
        """Reads the address the service reports once serving; names it after its port."""
        try:
            while not select.select([proc.ready], [], [], 0.5)[0]:
                _check_abort(proc, should_abort)
                if proc.popen.poll() is not None:
                    break  # its pipe may live on in a process it started: do not wait for EOF
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{proc.label} not serving after "
                                       f"{self.spec.start_timeout_s:.0f}s")
            line = proc.ready.readline().decode().strip() if proc.popen.poll() is None else ""
        finally:
            proc.ready.close()
            proc.ready = None
        if not line:  # it closed the pipe without serving: it is exiting
            try:
                proc.popen.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
            raise StartExited(f"{proc.label} exited with {proc.popen.returncode} while "
                              f"starting{proc.last_words()}")
        proc.address = line
        proc.name = proc.name.replace("{port}", line.rpartition(":")[2])
        if proc.name == "router":
            self.router_address = line

    def wait_routable(self, num_prefill: int, num_decode: int, timeout_s: float = 30.0,
                      should_abort: Callable[[], bool] | None = None) -> None:
        """Until the router's registry view has exactly these many live workers."""
        from client.channels import call_metadata
        from protos import router_pb2, router_pb2_grpc

        deadline = time.monotonic() + timeout_s
        flags = self.spec.router_flags()
        with _channel(flags, self.router_address) as ch:
            stub = router_pb2_grpc.RouterAdminStub(ch)
            while True:
                s = stub.GetClusterStats(router_pb2.ClusterStatsRequest(), timeout=5.0,
                                         metadata=call_metadata(self.spec.admin_key()))
                if (s.num_prefill_workers, s.num_decode_workers) == (num_prefill, num_decode):
                    return
                if should_abort is not None and should_abort():
                    raise StartAborted("the router's view of the workers: start given up for "
                                       "a stop")
                if time.monotonic() > deadline:
                    raise RuntimeError(f"router sees {s.num_prefill_workers} prefill and "
                                       f"{s.num_decode_workers} decode workers, expected "
                                       f"{num_prefill} and {num_decode}")
                time.sleep(0.1)

    def wait_listed(self, proc: Proc, timeout_s: float = 30.0,
                    should_abort: Callable[[], bool] | None = None) -> str | None:
        """Until the router lists worker ``proc`` (one started again) as serving its model:
        None then. RuntimeError when it refuses it (the model's folder changed since the
        router read it) or does not list it in time, as a cluster that is not routable fails
        its start. Why it cannot tell, when it cannot: the worker exited meanwhile (its exit
        is the caller's to count, as any other), or the registry (Redis) is unreachable (the
        worker registers once it is back, as it would at any time; waiting here would also
        hold up the restart of a bundled Redis). Nothing to check while the router is down:
        the one started again reads the registry afresh."""
        from client.channels import call_metadata
        from client.failover import has_mark
        from protos import router_pb2, router_pb2_grpc
        from router.errors import REGISTRY_UNREACHABLE_KEY

        deadline = time.monotonic() + timeout_s
        last = "not listed"
        with _channel(self.spec.router_flags(), self.router_address) as ch:
            stub = router_pb2_grpc.RouterAdminStub(ch)
            while self._router_running():
                _check_abort(proc, should_abort)
                if proc.popen.poll() is not None:
                    return f"{proc.label} exited with {proc.popen.returncode}"
                try:
                    listed = stub.ListWorkers(router_pb2.ListWorkersRequest(role=proc.role),
                                              timeout=5.0,
                                              metadata=call_metadata(self.spec.admin_key()))
                    for info, why in zip(listed.workers, listed.model_mismatch):
                        if info.worker_id == proc.name or info.address == proc.address:
                            if why:
                                raise RuntimeError(f"{proc.label} serves, but the router sends "
                                                   f"it no requests: {why}")
                            return None
                except grpc.RpcError as e:
                    last = f"{e.code().name}: {e.details()}"
                    # The router answers, its registry does not (router/admin.py's _registry).
                    if has_mark(e, REGISTRY_UNREACHABLE_KEY):
                        return last
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the router does not list {proc.label} after "
                                       f"{timeout_s:.0f}s (last: {last})")
                time.sleep(0.1)
        return None

    def _router_running(self) -> bool:
        return any(p.role == "router" and p.popen.poll() is None for p in self.procs)

    # --- stop -----------------------------------------------------------------------------
    def stop_proc(self, proc: Proc, grace_s: float | None = None) -> int:
        """SIGTERM (drain, then stop), SIGKILL after the grace period (None: the service's
        worst case with the spec's drain); the exit code. Whatever the service started and did
        not stop is killed too."""
        if grace_s is None:
            grace_s = stop_grace_s(self.spec.drain_timeout_s)
        pin_family(proc)
        try:
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
        finally:
            kill_family(proc)
            if proc.ready is not None:
                proc.ready.close()
                proc.ready = None
            if proc.tail is not None:  # what it wrote last, passed on before we go on
                proc.tail.closed.wait(5.0)
                proc.tail.close()
        if proc in self.procs:
            self.procs.remove(proc)
            if proc.gpus is not None and self.gpu_plan is not None:
                self.gpu_plan.workers.remove(proc.gpus)  # its GPUs are free for the next one
        return proc.popen.returncode

    def stop(self) -> None:
        # Families first: once a service exits, the workers it left behind are no one's child.
        for proc in self.procs:
            pin_family(proc)
        # The routers first, and to the end of their drain: a request they still run may need
        # a worker for its next leg (the decode after its prefill), and a worker told to stop
        # leaves the registry and refuses new calls at once. Then the workers, together.
        routers = [p for p in self.procs if p.role == "router"]
        for proc in routers:
            if proc.popen.poll() is None:
                proc.popen.send_signal(signal.SIGTERM)
        for proc in routers:
            self.stop_proc(proc)
        for proc in self.procs:
            if proc.popen.poll() is None:
                proc.popen.send_signal(signal.SIGTERM)
        for proc in list(self.procs):
            self.stop_proc(proc)
        if self.redis is not None:
            self.redis.stop()
            self.redis = None
        if self._share_dir is not None:
            share_dirs.remove(self._share_dir)
            self._share_dir = None
        if self.log_dir is not None:
            log_dirs.remove(self.log_dir)
            self.log_dir = None
        if self._lifeline is not None:
            for fd in self._lifeline:
                os.close(fd)
            self._lifeline = None

    def __enter__(self) -> Cluster:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


class StartAborted(Exception):
    """A service's start was given up for a stop asked meanwhile (``should_abort``)."""


class StartExited(RuntimeError):
    """A service exited before it served (a refused configuration, a model folder it could
    not read): the message says with what and quotes its last lines."""


def _check_abort(proc: Proc, should_abort: Callable[[], bool] | None) -> None:
    # Polled while a service starts: a stop must not wait out a start (minutes for a large
    # model, up to start_timeout_s).
    if should_abort is not None and should_abort():
        raise StartAborted(f"{proc.label}: start given up for a stop")


def _channel(args: list[str], address: str) -> grpc.Channel:
    """A channel to the service started with ``args``: TLS when it serves TLS, trusting its
    own certificate (a local cluster's is typically self-signed) under a name it carries.
    The service is on loopback, but a certificate made for ``localhost`` (or a host name)
    need not name 127.0.0.1: checked against the address, it failed every probe, and the
    start waited out its whole timeout for a router that served all along."""
    cert = flag_value(args, "--tls-cert-file")
    if cert is None:
        return grpc.insecure_channel(address)
    with open(cert, "rb") as f:
        creds = grpc.ssl_channel_credentials(f.read())
    name = _name_to_check(cert, address.rpartition(":")[0].strip("[]"))
    options = [] if name is None else [("grpc.ssl_target_name_override", name)]
    return grpc.secure_channel(address, creds, options=options)


def _name_to_check(cert_file: str, host: str) -> str | None:
    """The name a TLS probe of ``host`` checks the certificate against: None (the host) when
    the certificate names it or cannot be read here, else a DNS name it carries (or its
    common name)."""
    import ssl

    try:
        # The standard library's only certificate parser without a handshake; private, so
        # its absence or failure leaves the probe as it was.
        decoded = ssl._ssl._test_decode_cert(cert_file)
    except Exception:  # noqa: BLE001 - AttributeError, ssl.SSLError, OSError
        return None
    names = [v for kind, v in decoded.get("subjectAltName", ()) if kind in ("DNS", "IP Address")]
    if host in names:
        return None
    dns = [v for kind, v in decoded.get("subjectAltName", ()) if kind == "DNS" and "*" not in v]
    common = [v for rdn in decoded.get("subject", ()) for k, v in rdn if k == "commonName"]
    return (dns or common or [None])[0]
