"""Where `pdserve up` puts workers on GPUs (router/gpu_placement.py), how the launcher hands each
worker its GPUs and memory share, and the per-process KV budget that makes a shared GPU work.
No GPU needed: the placement is arithmetic, the launcher's workers here are stand-in processes,
and the budget reads a fake device."""
from __future__ import annotations

import contextlib
import subprocess

import pytest
import torch

from engine import setup
from router.gpu_placement import GpuPlan, WorkerGpus, plan_gpus, visible_gpus
from router.launcher import Cluster, ClusterSpec, Proc

GIB = 1 << 30


def _layout(plan):
    return [(w.role, w.gpus, round(w.gpu_memory_utilization, 4), w.shared) for w in plan.workers]


def test_enough_gpus_give_every_worker_its_own():
    plan = plan_gpus(1, 2, 2, ("0", "1", "2", "3"))
    assert _layout(plan) == [("prefill", ("0", "1"), 0.9, False), ("decode", ("2",), 0.9, False),
                             ("decode", ("3",), 0.9, False)]
    assert not plan.shared


def test_one_gpu_is_shared_and_its_memory_split():
    plan = plan_gpus(1, 1, 1, ("0",), utilization=0.8)
    assert _layout(plan) == [("prefill", ("0",), 0.4, True), ("decode", ("0",), 0.4, True)]
    assert plan.workers[0].describe() == "prefill on GPU 0, 0.40 of its memory"


def test_a_tp_worker_never_splits_over_the_end_of_the_list():
    # 3 GPUs, two TP-2 prefill workers: the second wraps to GPUs 0,1 rather than taking 2,0,
    # so the decode worker keeps GPU 2 to itself.
    plan = plan_gpus(2, 2, 1, ("0", "1", "2"))
    assert _layout(plan) == [("prefill", ("0", "1"), 0.45, True),
                             ("prefill", ("0", "1"), 0.45, True), ("decode", ("2",), 0.9, False)]


def test_the_torch_backend_refuses_a_prefill_and_a_decode_worker_on_one_gpu():
    with pytest.raises(ValueError, match="NCCL"):
        plan_gpus(1, 1, 1, ("0",), kv_transfer_backend="torch")
    # Prefill workers sharing GPUs among themselves pair with nobody there: allowed.
    plan_gpus(2, 2, 1, ("0", "1", "2"), kv_transfer_backend="torch")


@pytest.mark.parametrize("kwargs, match", [
    (dict(num_prefill=1, prefill_tp=4, num_decode=1, gpus=("0", "1")), "-tp 4 needs 4 GPUs"),
    (dict(num_prefill=1, prefill_tp=1, num_decode=1, gpus=()), "no GPU"),
    (dict(num_prefill=1, prefill_tp=1, num_decode=1, gpus=("0",), utilization=0.0),
     "gpu-memory-utilization"),
])
def test_plans_the_gpus_cannot_hold_raise_value_error(kwargs, match):
    with pytest.raises(ValueError, match=match):
        plan_gpus(**kwargs)


def test_a_worker_added_later_gets_what_the_workers_on_its_gpus_leave():
    """The workers there keep the shares plan_gpus gave them, and each engine reads its share
    as a part of the whole device (engine/setup.py): a newcomer given 0.9 / 2 put 1.35 of
    GPU 0 in shares, and found too little free memory to start."""
    plan = plan_gpus(1, 1, 2, ("0", "1", "2"))
    assert [w.gpus for w in plan.workers] == [("0",), ("1",), ("2",)]
    with pytest.raises(ValueError, match=r"would get 0\.00 of GPU 0's memory: its workers "
                                         r"hold 0\.90 of it"):
        plan.next_for("decode", 1, 0.9)
    plan.workers.remove(plan.workers[2])  # decode on GPU 2 stopped
    late = plan.next_for("decode", 1, 0.9)
    assert (late.gpus, late.gpu_memory_utilization, late.shared) == (("2",), 0.9, False)
    # Three workers at 0.3 on one GPU, one stopped: the next gets its 0.3, and no more fits.
    one = plan_gpus(2, 1, 1, ("0",))
    one.workers.remove(one.workers[0])
    late = one.next_for("prefill", 1, 0.9)
    assert (late.gpus, round(late.gpu_memory_utilization, 4), late.shared) == (("0",), 0.3, True)
    with pytest.raises(ValueError, match="GPU 0's memory"):
        one.next_for("decode", 1, 0.9)
    # The GPU with memory left, not the first with as few workers; a TP worker gets the least
    # its GPUs have left.
    uneven = GpuPlan([WorkerGpus("prefill", ("0",), 0.9, False),
                      WorkerGpus("decode", ("1",), 0.45, True)], ("0", "1"))
    assert uneven.next_for("decode", 1, 0.9).gpus == ("1",)
    tp = GpuPlan([WorkerGpus("decode", ("0",), 0.45, True)], ("0", "1"))
    late = tp.next_for("prefill", 2, 0.9)
    assert (late.gpus, late.gpu_memory_utilization, late.shared) == (("0", "1"), 0.45, True)
    # Where the workers' own flag sets their memory, the launcher hands out no share to refuse.
    flagged = plan_gpus(1, 1, 1, ("0",))
    flagged.split_memory = False
    assert flagged.next_for("decode", 1, 0.9).gpus == ("0",)
    with pytest.raises(ValueError, match="-tp 4 needs 4 GPUs"):
        plan.next_for("prefill", 4, 0.9)
    torch_plan = plan_gpus(1, 1, 1, ("0", "1"), kv_transfer_backend="torch")
    with pytest.raises(ValueError, match="NCCL"):
        torch_plan.next_for("decode", 1, 0.9)  # both GPUs hold a worker; GPU 0 a prefill one


def test_visible_gpus_follow_the_launchers_cuda_visible_devices():
    assert visible_gpus(2, {}) == ("0", "1")
    assert visible_gpus(2, {"CUDA_VISIBLE_DEVICES": "3, 5"}) == ("3", "5")
    uuids = "GPU-aaaa,GPU-bbbb"
    assert visible_gpus(2, {"CUDA_VISIBLE_DEVICES": uuids}) == ("GPU-aaaa", "GPU-bbbb")


@pytest.fixture
def stand_in_spawns(monkeypatch):
    """Cluster._spawn starting `sleep` instead of a service: what each worker was given."""
    spawned = []

    def spawn(self, name, args, env=None):
        proc = Proc(name, "", subprocess.Popen(["sleep", "60"]), template=name, args=args,
                    env=env)
        self.procs.append(proc)
        spawned.append(proc)
        return proc

    monkeypatch.setattr(Cluster, "_spawn", spawn)
    return spawned


def _flag(args, name):
    return args[args.index(name) + 1] if name in args else None


@contextlib.contextmanager
def _placing(spec):
    """A cluster of ``spec`` with its GPU plan made, as ``start`` makes it, that adds workers
    (stand-ins) one by one; every one of them stopped after."""
    cluster = Cluster(spec)
    cluster.gpu_plan = spec.gpu_plan()
    cluster._gpu_slots = list(cluster.gpu_plan.workers) if cluster.gpu_plan else []
    try:
        yield cluster
    finally:
        for p in list(cluster.procs):
            cluster.stop_proc(p, grace_s=5)
        cluster.stop()  # its core-share folder


def test_the_launcher_hands_each_worker_its_gpus_and_share(stand_in_spawns):
    spec = ClusterSpec(num_prefill=1, num_decode=2, worker_args=["--device", "cuda"],
                       gpus=("4", "7"), redis_url="redis://127.0.0.1:1/0")
    with _placing(spec) as cluster:
        for role in ("prefill", "decode", "decode"):
            cluster.add_worker(role, wait=False)
        got = [(p.env["CUDA_VISIBLE_DEVICES"], _flag(p.args, "--gpu-memory-utilization"))
               for p in stand_in_spawns]
        assert got == [("4", "0.45"), ("7", "0.9"), ("4", "0.45")]
        # A stopped worker gives its place up: the next one added takes GPU 7 whole.
        cluster.stop_proc(stand_in_spawns[1], grace_s=5)
        cluster.add_worker("decode", wait=False)
        assert stand_in_spawns[3].env["CUDA_VISIBLE_DEVICES"] == "7"
        assert _flag(stand_in_spawns[3].args, "--gpu-memory-utilization") == "0.9"


def test_a_worker_flag_wins_and_a_pinned_or_cpu_device_is_left_alone(stand_in_spawns):
    given = ClusterSpec(worker_args=["--device", "cuda", "--gpu-memory-utilization", "0.3"],
                        gpus=("0",))
    plan = given.gpu_plan()
    assert plan is not None and not plan.split_memory  # GPUs placed, the flag left as given
    assert ClusterSpec(worker_args=["--device", "cuda:1"], gpus=("0",)).gpu_plan() is None
    assert ClusterSpec(worker_args=["--device", "cpu"], gpus=("0",)).gpu_plan() is None
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        ClusterSpec(gpu_memory_utilization=1.2)


class _FakeDevice:
    """One GPU's memory as torch.cuda reports it: everyone's use, and this process's own."""

    def __init__(self, total):
        self.total, self.used, self.own = total, 0, 0

    def patch(self, monkeypatch):
        monkeypatch.setattr(torch.cuda, "mem_get_info", lambda d=None: (self.total - self.used,
                                                                          self.total))
        monkeypatch.setattr(torch.cuda, "memory_reserved", lambda d=None: self.own)


def test_two_workers_sharing_a_gpu_get_equal_caches_whichever_sizes_first(monkeypatch):
    dev = _FakeDevice(80 * GIB)
    dev.patch(monkeypatch)
    cuda = torch.device("cuda", 0)
    # Both loaded their weights (1 GiB) beside a CUDA context (0.5 GiB) each.
    dev.used = 2 * (1 * GIB + GIB // 2)
    dev.own = 1 * GIB
    first = setup._cuda_kv_budget(cuda, 0.45)
    dev.used += first  # the first allocates its cache; the second sizes its own now
    second = setup._cuda_kv_budget(cuda, 0.45)
    assert first == second == 0.45 * 80 * GIB - 1 * GIB
    assert dev.used + second <= dev.total


def test_a_share_the_gpu_cannot_hold_is_refused_with_a_clear_error(monkeypatch):
    dev = _FakeDevice(80 * GIB)
    dev.patch(monkeypatch)
    dev.used, dev.own = 30 * GIB, 1 * GIB  # another program holds 29 GiB of it
    with pytest.raises(ValueError, match="only 50.0 GiB is free.*Lower --gpu-memory-util"):
        setup._cuda_kv_budget(torch.device("cuda", 0), 0.9)
    assert setup._cuda_kv_budget(torch.device("cuda", 0), 0.6) == 0.6 * 80 * GIB - 1 * GIB


@pytest.mark.parametrize("kwargs, flag", [
    (dict(kv_cache_memory_gib=10), "--kv-cache-memory-gib 10"),
    (dict(num_gpu_blocks=10 * 1024), "--num-gpu-blocks 10240"),
])
def test_an_explicit_cache_the_gpu_cannot_hold_is_refused_before_it_is_allocated(
        monkeypatch, kwargs, flag):
    """A budget set by flag is checked against the device's free memory, as the utilization
    share is: torch's out-of-memory error was a traceback from inside the allocation."""
    from engine.config import EngineConfig

    dev = _FakeDevice(80 * GIB)
    dev.patch(monkeypatch)
    dev.used = 72 * GIB
    cuda = torch.device("cuda", 0)
    with pytest.raises(ValueError, match=f"{flag} asks for a KV cache of 10.00 GiB, but cuda:0 "
                                         "has only 8.00 GiB free"):
        setup.kv_capacity_blocks(EngineConfig(model="micro-llama", **kwargs), 1 << 20, cuda)
    dev.used = 70 * GIB
    assert setup.kv_capacity_blocks(EngineConfig(model="micro-llama", **kwargs), 1 << 20,
                                    cuda) == 10 * 1024


def test_worker_cli_passes_gpu_memory_utilization_and_checks_it():
    from engine.cli import build_parser
    from engine.cli_serve import _worker_config

    args = build_parser().parse_args(["decode", "--gpu-memory-utilization", "0.45"])
    assert _worker_config(args, "decode").engine.gpu_memory_utilization == 0.45
    bad = build_parser().parse_args(["decode", "--gpu-memory-utilization", "0"])
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        _worker_config(bad, "decode")


@pytest.mark.parametrize("device, engine_process, tp, expected", [
    ("cuda", None, 1, [True, True]),  # the default on GPUs
    ("cuda", None, 2, [False, True]),  # ... for TP 1 workers only
    ("cuda", False, 1, [False, False]),  # --no-engine-process
    ("cpu", None, 1, [False, False]),  # the default on CPUs
    ("cpu", True, 1, [True, True]),  # --engine-process
])
def test_workers_on_gpus_step_their_engine_in_a_process_of_their_own(
        stand_in_spawns, monkeypatch, device, engine_process, tp, expected):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)  # the launcher shares cores out
    spec = ClusterSpec(num_prefill=1, num_decode=1, prefill_tp=tp, worker_args=["--device", device],
                       gpus=("0", "1", "2"), redis_url="redis://127.0.0.1:1/0",
                       engine_process=engine_process)
    with _placing(spec) as cluster:
        for role in ("prefill", "decode"):
            cluster.add_worker(role, wait=False)
        assert [p.args.count("--engine-process") == 1 for p in stand_in_spawns] == expected
        # Workers on GPUs borrow no cores: they compute there.
        assert ["--core-share" in p.args for p in stand_in_spawns] == [device == "cpu"] * 2


def test_up_takes_engine_process_either_way():
    from engine.cli import build_parser
    from engine.cli_up import up_spec

    for flags, expected in (([], None), (["--engine-process"], True),
                            (["--no-engine-process"], False)):
        args = build_parser().parse_args(["up", *flags])
        assert up_spec(args).engine_process is expected
