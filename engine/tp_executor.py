"""TP>1: rank 0 in the engine's process, ranks 1..k-1 in spawned worker processes.

Start-up: rank 0 opens a TCP store, spawns the workers, loads its own shard while they load
theirs, sizes the KV cache to the smallest rank's budget, and runs one collective once every
rank reports ready. Each step: the flattened input goes down every worker's pipe, then all
ranks run the forward together. A worker that dies is noticed by a monitor thread and by the
next collective (gloo sees the closed socket at once), and every later call fails with the
same ``ExecutorError``: the engine never hangs on a dead rank. One that is stopped or wedged
instead stays connected: while the engine is idle its checks ping every worker
(engine.tp_liveness), and one that does not answer in time fails the engine the same way.
"""
from __future__ import annotations

import datetime
import io
import logging
import os
import socket
import subprocess
import sys
import threading
import time
import weakref
from concurrent.futures import Future
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait

import torch
import torch.distributed as dist

from engine import tp_comm, tp_liveness
from engine.executor import Executor, make_rank_agent
from engine.executor_error import ExecutorError
from engine.kv_layout import KVCacheLayout, make_layout
from engine.model_config import ModelConfig
from engine.model_runner import ModelInput, ModelRunner
from engine.setup import (RankSpec, cuda_graph_config, load_rank_model, rank_capacity_blocks,
                          spec_to_json)
from engine.step_codec import encode_model_input
from engine.process_exit import describe_exit, popen_tied
from engine.thread_names import named_thread
from engine.tp_kv_channel import KVChannelClient
from engine.tp_worker import worker_threads

logger = logging.getLogger(__name__)

# At shutdown the workers told to quit get this long, all together, to exit (a clean exit takes
# well under a second); the rest are killed. One that never answers (stopped, wedged in a
# collective or in its own teardown) must not hold the engine's shutdown past the launcher's
# grace (engine.async_engine's budget).
_QUIT_GRACE_S = 5.0
# SIGKILL ends even a stopped process; this covers its exit and reaping.
_KILL_WAIT_S = 2.0
_DEATH_REPORT_S = 5.0


@dataclass
class _Worker:
    rank: int
    process: subprocess.Popen
    conn: Connection
    # A pidfd, readable once the process has exited, so wait() can watch it beside the pipe.
    # Wrapped in a file object that closes it when the last holder (the monitor) lets go.
    sentinel: io.FileIO
    # The KV-transfer pull channel (engine.tp_kv_channel); None without a transfer backend.
    kv_conn: Connection | None = None
    # What it died of, once told (_describe): the monitor and a failing step may both ask,
    # and only the first read finds the worker's last message on the pipe.
    death: str | None = None
    death_lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def exitcode(self) -> int | None:
        return self.process.poll()


class MultiprocExecutor(Executor):
    def __init__(self, spec: RankSpec, model_config: ModelConfig) -> None:
        size = spec.config.tensor_parallel_size
        device = spec.rank_device(0)
        self._timeout = spec.config.tp_startup_timeout_s
        self._error: ExecutorError | None = None
        self._error_lock = threading.Lock()  # the monitor and a failing step race to report
        self._closing = False
        self._step_in_flight = False  # rank 0 inside a forward: shutdown may have to unblock it
        # Held by whatever uses the workers' control pipes (a step from its send to the end
        # of its forward, a read with its answer, an idle ping): their messages never
        # interleave, and a ping never waits on a rank busy in a step.
        self._pipe_lock = threading.Lock()
        self._ping_interval = spec.config.tp_idle_ping_interval_s
        self._ping_timeout = spec.config.tp_idle_ping_timeout_s
        self.idle_pings = 0  # answered rounds (tests, inspection)
        self._kv_channel: KVChannelClient | None = None
        self._previous_threads = torch.get_num_threads()
        if device.type == "cpu":
            torch.set_num_threads(worker_threads(size))
        self._store = dist.TCPStore("127.0.0.1", 0, size, True, wait_for_workers=False,
                                    timeout=datetime.timedelta(seconds=self._timeout))
        self.workers = _spawn_workers(spec, size, self._store.port)
        # Runs at garbage collection or interpreter exit if shutdown() was never called.
        self._finalizer = weakref.finalize(self, _stop_workers, list(self.workers))
        try:
            self.group = tp_comm.connect_tp_group(0, size, self._store, device)
            model = load_rank_model(spec, self.group)
            caps = [rank_capacity_blocks(spec, model_config, self.group)]
            caps += [self._expect_json(w, tp_comm.OP_HELLO)["capacity_blocks"]
                     for w in self.workers]
            self.num_blocks = min(caps)
            for w in self.workers:
                tp_comm.send_json(w.conn, tp_comm.OP_NUM_BLOCKS, {"num_blocks": self.num_blocks})
            layout = make_layout(model_config, self.num_blocks, spec.config.block_size,
                                 spec.torch_dtype, 0, size)
            self.runner = ModelRunner(model, layout, spec.torch_dtype, device,
                                      cuda_graph_config(spec, model_config, self.num_blocks))
            self._layouts = [layout] + [
                KVCacheLayout.from_json(self._expect(w, tp_comm.OP_READY))
                for w in self.workers]
            self.kv_agent = make_rank_agent(spec, self.runner)
            if self.kv_agent is not None:
                from kvtransfer import KVAgentHandle
                # Each worker rank registered its own cache with its own agent.
                self._kv_handles = [self.kv_agent.handle()] + [
                    KVAgentHandle.from_bytes(self._expect(w, tp_comm.OP_OK))
                    for w in self.workers]
                self._kv_channel = KVChannelClient([w.kv_conn for w in self.workers])
            try:
                self.group.all_reduce(torch.zeros(1, device=device))
            except RuntimeError as e:  # a rank that died after its last answer
                raise self._fail(f"start-up failed: {e}") from None
        except BaseException:
            self.shutdown()
            raise
        # The monitor holds only a weak reference, so an executor nobody shut down can still
        # be collected (its finalizer then stops the workers and the monitor wakes and ends).
        named_thread(_monitor, "pdserve-tp-monitor",
                     (weakref.ref(self), list(self.workers))).start()
        # When the ranks last proved alive (a step or a ping): an idle ping is due from then.
        self._last_contact = time.monotonic()

    # --- steps ----------------------------------------------------------------------------
    def execute_model(self, inp: ModelInput) -> torch.Tensor | None:
        # In flight before the check: a shutdown on another thread sets _closing, then reads
        # this, so either the step sees it closing or it sees the step (and leaves the group
        # and the device memory to it). Set after the check, a shutdown in between freed them
        # under the step.
        self._step_in_flight = True
        try:
            self._check_usable()
            msg = encode_model_input(inp)
            with self._pipe_lock:
                logits = self._step(inp, msg)
            self._last_contact = time.monotonic()  # a busy engine never pings
            return logits
        finally:
            self._step_in_flight = False

    def _step(self, inp: ModelInput, msg: bytes) -> torch.Tensor | None:
        # A worker that stopped reading would block a large step's send for good (a small
        # one fits the socket and its collective times out): the send gets as long.
        deadline = time.monotonic() + tp_comm.COLLECTIVE_TIMEOUT.total_seconds()
        try:
            for w in self.workers:
                try:
                    tp_comm.send_by(w.conn, tp_comm.OP_STEP, msg, deadline)
                except TimeoutError as e:
                    raise TimeoutError(f"tensor-parallel rank {w.rank} (pid {w.process.pid}) "
                                       f"is stopped or wedged: {e}") from None
            return self.runner.run(inp)
        except (OSError, RuntimeError) as e:
            raise self._fail(f"the step failed: {e}") from None
        except BaseException as e:
            # Interrupted between sending the step and the end of its forward (a Ctrl-C, a
            # notebook's interrupt): the other ranks are still in this step's collectives, and
            # the next step's would pair with theirs (gloo aborts the process on the mismatch).
            self._set_error(f"a step was interrupted ({type(e).__name__}); the ranks are "
                            "out of step")
            self._abort_collectives()
            raise

    def kv_cache_layouts(self) -> list[KVCacheLayout]:
        return list(self._layouts)

    def start_worker_pulls(self, remotes: list, remote_block_ids: list[int],
                           local_block_ids: list[int], deadline: float) -> list[Future]:
        """Starts the same pull on every worker rank, each into its own cache (its own heads),
        by ``deadline`` (time.monotonic(): the ranks share this host's clock)."""
        self._check_usable()
        if self._kv_channel is None:
            raise ValueError("this engine has no KV transfer backend")
        from kvtransfer.errors import TransferError

        futures = []
        for w in self.workers:
            try:
                futures.append(self._kv_channel.submit(w.rank, remotes, remote_block_ids,
                                                       local_block_ids, deadline))
            except TransferError as e:
                # As a failed future: the caller still waits for the ranks already started,
                # which may be writing into the blocks.
                failed: Future = Future()
                failed.set_exception(e)
                futures.append(failed)
        return futures

    def forget_worker_peers(self, agent_names: list[str]) -> None:
        self._check_usable()
        if self._kv_channel is not None:
            self._kv_channel.forget(agent_names)

    def read_blocks(self, rank: int, block_ids: list[int]) -> torch.Tensor:
        """kv_cache[block_ids] of ``rank`` as a CPU tensor (inspection and tests):
        [len(block_ids), num_layers, 2, block_size, num_kv_heads, head_size]."""
        self._check_usable()
        # Checked here for every rank: a worker refusing them dies (its loop ends on the
        # error), and the whole engine with it; rank 0 read -1 as the last block.
        if isinstance(rank, bool) or not isinstance(rank, int) or \
                not 0 <= rank < len(self._layouts):
            raise ValueError(f"rank must be in [0, {len(self._layouts)}), got {rank!r}")
        num_blocks = self._layouts[rank].num_blocks
        if not all(isinstance(i, int) and 0 <= i < num_blocks for i in block_ids):
            raise ValueError(f"block ids out of range [0, {num_blocks})")
        if rank == 0:
            return self.runner.kv_cache[block_ids].cpu()
        w = self.workers[rank - 1]
        with self._pipe_lock:  # an idle ping's answer must not be taken for this one's
            tp_comm.send_json(w.conn, tp_comm.OP_READ_BLOCKS, {"block_ids": list(block_ids)})
            raw = self._expect(w, tp_comm.OP_OK)
        layout = self._layouts[rank]
        shape = (len(block_ids), *layout.shape[1:])
        flat = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
        return flat.view(self.runner.kv_cache.dtype).view(shape)

    # --- failure --------------------------------------------------------------------------
    def check_health(self) -> None:
        """Raises once a rank died, or (pinging it when due) stopped answering while idle.
        The engine thread calls it between steps only (engine.async_engine)."""
        self._check_usable()
        if self._ping_interval and \
                time.monotonic() - self._last_contact >= self._ping_interval:
            self._ping_idle()

    def _ping_idle(self) -> None:
        # Not while anything else uses the pipes: a step in flight is proof enough of life for
        # now (and a rank in a long step would answer only after it), and two messages at
        # once would interleave. Skipped, not waited for: the caller is the engine's own
        # thread, which must not wait out another thread's read.
        if not self._pipe_lock.acquire(blocking=False):
            return
        try:
            self._check_usable()
            try:
                silent = tp_liveness.ping(self.workers, self._ping_timeout)
            except tp_liveness.PingFailed as e:  # its last word, read here: keep its text
                self._set_error(str(e))
                raise self._error from None
            except (EOFError, OSError, ValueError) as e:
                if self._closing:  # shutdown closed the pipes under the ping
                    raise ExecutorError("the executor is shut down") from None
                raise self._fail(f"an idle ping failed: {e}") from None
            if silent is not None:
                # What the step timeout would find at the next request, minutes later: the
                # engine dies now, the worker reports NOT_SERVING and exits (its shutdown
                # kills the silent rank), and its supervisor starts it again.
                self._set_error(f"tensor-parallel rank {silent.rank} (pid "
                                f"{silent.process.pid}) did not answer an idle ping within "
                                f"{self._ping_timeout:g} s (--tp-idle-ping-timeout-s): it is "
                                "stopped or wedged")
                raise self._error
            self.idle_pings += 1
            self._last_contact = time.monotonic()
        finally:
            self._pipe_lock.release()

    def _check_usable(self) -> None:
        if self._error is not None:
            raise self._error
        if self._closing:
            raise ExecutorError("the executor is shut down")

    def _fail(self, context: str) -> ExecutorError:
        """The error every later call raises, naming the worker that died when one did."""
        dead = self._wait_for_death()
        self._set_error(_describe(dead) if dead else context)
        return self._error

    def _wait_for_death(self) -> _Worker | None:
        ready = wait([w.sentinel for w in self.workers], timeout=_DEATH_REPORT_S)
        for w in self.workers:
            if w.sentinel in ready:
                return w
        return None

    def _on_worker_death(self, dead: _Worker) -> None:
        if not self._closing and self._set_error(_describe(dead)):
            self._abort_collectives()

    def _set_error(self, reason: str) -> bool:
        """Makes every later call raise ``reason``; False when an error was set already."""
        with self._error_lock:
            if self._error is not None:
                return False
            self._error = ExecutorError(f"tensor-parallel executor failed: {reason}")
            return True

    def _abort_collectives(self) -> None:
        group, runner = getattr(self, "group", None), getattr(self, "runner", None)
        if group is not None and group.backend is not None and runner is not None and (
                runner.device.type == "cuda"):
            # NCCL waits forever on a dead peer; aborting unblocks rank 0's collective. (gloo
            # sees a dead peer's closed socket by itself.)
            group.backend.abort()

    # --- start-up and shutdown ------------------------------------------------------------
    def _expect(self, w: _Worker, op: bytes) -> bytes:
        ready = wait([w.conn, w.sentinel], timeout=self._timeout)
        if not ready:
            raise ExecutorError(f"tensor-parallel rank {w.rank} did not answer within "
                                f"{self._timeout:.0f} s")
        try:
            got, payload = tp_comm.recv(w.conn)
        except (EOFError, OSError):
            raise ExecutorError(f"tensor-parallel executor failed: {_describe(w)}") from None
        if got == tp_comm.OP_ERROR:
            raise ExecutorError(payload.decode(errors="replace").strip())
        if got != op:
            raise ExecutorError(f"tensor-parallel rank {w.rank} sent op {got!r}, expected {op!r}")
        return payload

    def _expect_json(self, w: _Worker, op: bytes) -> dict:
        return tp_comm.parse_json(self._expect(w, op))

    def shutdown(self) -> None:
        if self._closing:
            return
        self._closing = True
        # Read once: a step that starts now sees _closing and clears its flag again, and
        # must not leave the device memory held by a later read of it.
        in_flight = self._step_in_flight
        self._finalizer()  # bounded: workers that do not quit in time are killed
        if in_flight:
            # The engine is stopping under a step (its thread did not finish in time): the
            # workers are gone now, so the step's collective must fail rather than wait on them.
            self._abort_collectives()
        if self._kv_channel is not None:
            self._kv_channel.close()
        if self.kv_agent is not None:
            self.kv_agent.close()
            self.kv_agent = None
        if not in_flight:
            self._release_device_memory()
        # Their listening sockets (the store's, gloo's) would stay open for as long as the
        # shut-down engine is referenced. A step still in flight holds the group itself.
        self._store = None
        group = getattr(self, "group", None)
        if group is not None and not in_flight:
            group.backend = None
        torch.set_num_threads(self._previous_threads)


def _monitor(ref: weakref.ref, workers: list[_Worker]) -> None:
    ready = wait([w.sentinel for w in workers])
    executor = ref()
    if executor is not None:
        executor._on_worker_death(next(w for w in workers if w.sentinel in ready))


def _spawn_workers(spec: RankSpec, size: int, port: int) -> list[_Worker]:
    """Starts ranks 1..size-1 as ``python -m engine.tp_worker`` processes.

    A fresh interpreter (not multiprocessing) so the caller's ``__main__`` is never re-run
    in the worker: a plain script without a ``__main__`` guard can still use TP. The spec
    travels as JSON on the command line, the control channel is an inherited socket.
    """
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    spec_json = spec_to_json(spec)
    with_kv = spec.config.kv_transfer_backend is not None
    workers = []
    for rank in range(1, size):
        ours, theirs = socket.socketpair()
        argv = [sys.executable, "-m", "engine.tp_worker", "--rank", str(rank), "--size",
                str(size), "--store-port", str(port), "--fd", str(theirs.fileno()),
                "--parent-pid", str(os.getpid()), "--spec", spec_json]
        fds = [theirs]
        kv_ours = None
        if with_kv:
            kv_ours, kv_theirs = socket.socketpair()
            argv += ["--kv-fd", str(kv_theirs.fileno())]
            fds.append(kv_theirs)
        proc = popen_tied(argv, pass_fds=tuple(s.fileno() for s in fds), env=env)
        for s in fds:
            s.close()
        workers.append(_Worker(rank, proc, Connection(ours.detach()),
                               io.FileIO(os.pidfd_open(proc.pid), closefd=True),
                               Connection(kv_ours.detach()) if kv_ours is not None else None))
    return workers


def _stop_workers(workers: list[_Worker]) -> None:
    """Asks every worker to quit, kills those still running ``_QUIT_GRACE_S`` later, and reaps
    them all: bounded however the workers behave, and no worker outlives the executor."""
    for w in workers:
        _send_quit(w)
    deadline = time.monotonic() + _QUIT_GRACE_S
    for w in workers:
        _wait_exit(w, deadline)
    for w in workers:
        if w.process.poll() is None:
            logger.warning("tensor-parallel rank %d (pid %d) did not quit within %.0f s; "
                           "killing it", w.rank, w.process.pid, _QUIT_GRACE_S)
            w.process.kill()
    deadline = time.monotonic() + _KILL_WAIT_S
    for w in workers:
        if not _wait_exit(w, deadline):
            logger.error("tensor-parallel rank %d (pid %d) survived SIGKILL for %.0f s",
                         w.rank, w.process.pid, _KILL_WAIT_S)
        w.conn.close()


def _send_quit(w: _Worker) -> None:
    # Never blocks: a worker that stopped reading may have filled its pipe, and a worker that
    # does not read the quit is killed anyway.
    try:
        os.set_blocking(w.conn.fileno(), False)
        tp_comm.send(w.conn, tp_comm.OP_QUIT)
    except OSError:
        pass


def _wait_exit(w: _Worker, deadline: float) -> bool:
    """Whether the worker has exited (and is reaped) by ``deadline``."""
    try:
        w.process.wait(max(0.0, deadline - time.monotonic()))
        return True
    except subprocess.TimeoutExpired:
        return False


def _describe(w: _Worker) -> str:
    """What a worker whose pidfd reported its exit died of (the same text for every caller)."""
    with w.death_lock:
        if w.death is None:
            w.death = _read_death(w)
        return w.death


def _read_death(w: _Worker) -> str:
    try:
        # wait(), not poll(): poll() answers None while another thread (the monitor, or the
        # step finding the same death) holds Popen's reaping lock, and the error then said
        # "exit code None".
        code = w.process.wait(timeout=_KILL_WAIT_S)
    except subprocess.TimeoutExpired:
        code = None
    text = f"tensor-parallel rank {w.rank} (pid {w.process.pid}) died ({describe_exit(code)})"
    try:
        if w.conn.poll(0):
            op, payload = tp_comm.recv(w.conn)
            if op == tp_comm.OP_ERROR:
                text += ": " + payload.decode(errors="replace").strip()
    except (EOFError, OSError):
        pass
    return text

