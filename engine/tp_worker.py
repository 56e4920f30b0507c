"""A tensor-parallel worker process (ranks 1..k-1): build the shard, then run every step.

The worker owns no scheduler and samples nothing: rank 0 sends it each step's flattened input
and it runs the same forward, so the layers' collectives pair up with rank 0's. It exits when
told to, when rank 0's pipe closes, or when its parent process disappears.
"""
from __future__ import annotations

import argparse
import datetime
import os
import signal
import socket
import time
import traceback
from multiprocessing.connection import Connection

import torch
import torch.distributed as dist

from engine import tp_comm
from engine.cpus import usable_cpus
from engine.executor import make_rank_agent
from engine.gc_policy import freeze_startup_heap
from engine.kv_layout import make_layout
from engine.model_config import ModelConfig
from engine.model_runner import ModelRunner
from engine.process_exit import die_with_parent, exit_process
from engine.setup import (RankSpec, cuda_graph_config, load_rank_model, rank_capacity_blocks,
                          spec_from_json)
from engine.step_codec import decode_model_input
from engine.thread_names import named_thread
from engine.tp_kv_channel import WorkerKVServer


def main(argv: list[str] | None = None) -> None:
    """``python -m engine.tp_worker``: started by rank 0 (engine.tp_executor), not by hand."""
    ap = argparse.ArgumentParser(prog="python -m engine.tp_worker")
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--size", type=int, required=True)
    ap.add_argument("--store-port", type=int, required=True)
    ap.add_argument("--fd", type=int, required=True, help="the control socket from rank 0")
    ap.add_argument("--parent-pid", type=int, default=0,
                    help="rank 0's pid: this rank is killed when it ends (0: not)")
    ap.add_argument("--spec", required=True, help="RankSpec as JSON")
    ap.add_argument("--kv-fd", type=int, default=None,
                    help="the KV-transfer pull channel from rank 0 (engine.tp_kv_channel)")
    args = ap.parse_args(argv)
    # The kernel's kill reaches a rank stopped or wedged, which the watch below cannot.
    die_with_parent(args.parent_pid)
    # A terminal's Ctrl-C or a service manager's SIGTERM reaches the whole process group:
    # rank 0 drains on it, which needs this rank. Its life is rank 0's to end (the quit op,
    # SIGKILL at shutdown, the death signal above).
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    conn = Connection(socket.socket(fileno=args.fd).detach())
    kv_conn = (Connection(socket.socket(fileno=args.kv_fd).detach())
               if args.kv_fd is not None else None)
    worker_main(spec_from_json(args.spec), args.rank, args.size, args.store_port, conn, kv_conn)


def worker_main(spec: RankSpec, rank: int, size: int, store_port: int,
                conn: Connection, kv_conn: Connection | None = None) -> None:
    """Runs rank ``rank`` until told to stop; reports a failure to rank 0, then exits."""
    _exit_with_parent(os.getppid())
    try:
        _serve(spec, rank, size, store_port, conn, kv_conn)
        # Rank 0 waits for this exit when it shuts down: skip the interpreter's teardown.
        exit_process()
    except (EOFError, BrokenPipeError):
        os._exit(0)  # rank 0 is gone: nothing left to serve
    except BaseException as e:  # report anything to rank 0 before dying
        text = f"tensor-parallel rank {rank}: {type(e).__name__}: {e}\n{traceback.format_exc()}"
        try:
            tp_comm.send(conn, tp_comm.OP_ERROR, text.encode())
        except OSError:
            pass
        os._exit(1)


def worker_threads(size: int) -> int:
    """CPU threads per rank: the process's thread budget (OMP_NUM_THREADS, else every CPU it
    may use) shared out, so ranks do not oversubscribe it."""
    budget = os.environ.get("OMP_NUM_THREADS", "")
    total = int(budget) if budget.isdigit() and int(budget) > 0 else usable_cpus()
    return max(1, total // size)


def _serve(spec: RankSpec, rank: int, size: int, store_port: int, conn: Connection,
           kv_conn: Connection | None) -> None:
    device = spec.rank_device(rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(worker_threads(size))
    store = dist.TCPStore("127.0.0.1", store_port, size, False,
                          timeout=datetime.timedelta(seconds=spec.config.tp_startup_timeout_s))
    group = tp_comm.connect_tp_group(rank, size, store, device)
    model = load_rank_model(spec, group)
    cfg = ModelConfig.from_pretrained(spec.model_path)
    tp_comm.send_json(conn, tp_comm.OP_HELLO,
                      {"capacity_blocks": rank_capacity_blocks(spec, cfg, group)})
    op, payload = tp_comm.recv(conn)
    if op == tp_comm.OP_QUIT:
        return
    if op != tp_comm.OP_NUM_BLOCKS:
        raise ValueError(f"expected the block count, got op {op!r}")
    num_blocks = int(tp_comm.parse_json(payload)["num_blocks"])
    layout = make_layout(cfg, num_blocks, spec.config.block_size, spec.torch_dtype, rank, size)
    runner = ModelRunner(model, layout, spec.torch_dtype, device,
                         cuda_graph_config(spec, cfg, num_blocks))
    tp_comm.send(conn, tp_comm.OP_READY, layout.to_json().encode())
    agent = make_rank_agent(spec, runner)
    kv_server = None
    if agent is not None:
        # Readers pull this rank's heads straight from its cache; rank 0 hands out the handle.
        tp_comm.send(conn, tp_comm.OP_OK, agent.handle().to_bytes())
        if kv_conn is not None:
            # Decode role: this rank pulls its own heads when rank 0 asks, beside the steps.
            kv_server = WorkerKVServer(kv_conn, agent)
    group.all_reduce(torch.zeros(1, device=device))  # connect while everyone is known alive
    freeze_startup_heap()  # engine/gc_policy.py: later full collections skip the model
    try:
        _loop(runner, conn, device, agent if spec.config.role == "prefill" else None)
    finally:
        if kv_server is not None:
            kv_server.close()
        if agent is not None:
            agent.close()


def _loop(runner: ModelRunner, conn: Connection, device: torch.device, owner=None) -> None:
    """``owner``: a prefill rank's agent. Leases live on rank 0, so this rank cannot see one
    come; a step is its cue that a reader of its heads may follow."""
    while True:
        op, payload = tp_comm.recv(conn)
        if op == tp_comm.OP_STEP:
            runner.run(decode_model_input(payload, device))
            if owner is not None:
                owner.reads_due_soon()
        elif op == tp_comm.OP_READ_BLOCKS:
            tp_comm.send(conn, tp_comm.OP_OK, read_blocks(runner, payload))
        elif op == tp_comm.OP_PING:
            tp_comm.send(conn, tp_comm.OP_OK)
        elif op == tp_comm.OP_QUIT:
            return
        else:
            raise ValueError(f"unknown control op {op!r}")


def read_blocks(runner: ModelRunner, payload: bytes) -> bytes:
    """Raw bytes of kv_cache[block_ids] (for inspection and tests)."""
    ids = tp_comm.parse_json(payload)["block_ids"]
    if not all(isinstance(i, int) and 0 <= i < runner.layout.num_blocks for i in ids):
        raise ValueError(f"block ids out of range [0, {runner.layout.num_blocks})")
    blocks = runner.kv_cache[ids].contiguous().cpu()
    return blocks.view(torch.uint8).numpy().tobytes()


def _exit_with_parent(parent_pid: int) -> None:
    """A worker whose parent died (even by SIGKILL) must not linger, even mid-collective."""
    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(0.5)
        os._exit(1)

    named_thread(watch, "pdserve-tp-parent-watch").start()


if __name__ == "__main__":
    main()
