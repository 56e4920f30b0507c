"""The runs behind ``pdserve bench serve``: the disaggregated cluster and its two baselines.

Every system starts once and stays up to the end: an idle cluster only wakes for heartbeats
and idle ticks, and the in-process engine only computes when stepped. So the closed loops can
alternate between the systems round by round (disagg, agg, in-process, then the reverse),
and a ratio compares runs minutes apart rather than a whole benchmark apart: this VM's speed
drifts by 10-30% within minutes. Each round has fresh prompts, so no system finds an earlier
round's prompts in its prefix cache. The Poisson points and the shared-prefix phase run on the
disaggregated cluster alone, after the rounds.
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import sys
from collections import defaultdict
from collections.abc import Callable, Iterator

from bench.cpu_usage import CPUMeter, CPUShare
from bench.serve import (Point, PrefixResult, ServeConfig, ServeReport, plan_points,
                         prefix_requests, throughput_ratios)
from bench.serve_load import (LoadRun, closed_loop, inprocess_closed_loop, one_request, poisson,
                              sequential)
from bench.serve_metrics import PointResult, summarize
from engine.grpc_experiments import ENV as GRPC_EXPERIMENTS

# Runs closed loops at the given points, returning each point with its run.
Runner = Callable[[list[Point]], list[tuple[Point, LoadRun]]]


def _log(*a) -> None:
    print("[bench serve]", *a, file=sys.stderr, flush=True)


# --- runners ------------------------------------------------------------------------------
async def _closed_loops(address: str, points: list[Point],
                        meter: CPUMeter) -> list[tuple[Point, LoadRun]]:
    from client import AsyncClient

    out = []
    async with AsyncClient(address, timeout=600.0) as client:
        await client.wait_ready()
        for pt in points:
            # The first KV transfer to a peer pays connection set-up; keep it out of the point.
            await sequential(client, pt.warmup)
            meter.start()
            run = await closed_loop(client, pt.reqs, int(pt.load))
            run.cpu = meter.stop()
            out.append((pt, run))
    return out


def _cluster_meter(cluster) -> CPUMeter:
    """Each role's services with the processes they started; the client is this process."""
    groups: dict[str, list[int]] = defaultdict(list)
    for proc in cluster.procs:
        groups[proc.role].append(proc.popen.pid)
    groups["client"] = [os.getpid()]  # alone: the clusters' services are its children too
    return CPUMeter(dict(groups), alone=frozenset({"client"}))


def _cluster_runner(cluster) -> Runner:
    return lambda points: asyncio.run(_closed_loops(cluster.router_address, points,
                                                    _cluster_meter(cluster)))


def _inprocess_runner(engine, stream_interval: int) -> Runner:
    def run(points: list[Point]) -> list[tuple[Point, LoadRun]]:
        meter = CPUMeter({"engine": [os.getpid()]}, alone=frozenset({"engine"}))
        out = []
        for pt in points:
            inprocess_closed_loop(engine, pt.warmup, 1, stream_interval)
            meter.start()
            load_run = inprocess_closed_loop(engine, pt.reqs, int(pt.load), stream_interval)
            load_run.cpu = meter.stop()
            out.append((pt, load_run))
        return out

    return run


# --- the disaggregated cluster's own phases -----------------------------------------------
async def _open_loops_and_prefix(address: str, cfg: ServeConfig,
                                 points: list[tuple[int, Point]], vocab: int,
                                 ) -> tuple[list[PointResult], PrefixResult | None]:
    from client import AsyncClient

    results = []
    async with AsyncClient(address, timeout=600.0) as client:
        await client.wait_ready()
        for k, pt in points:
            await sequential(client, pt.warmup)
            run = await poisson(client, pt.reqs, pt.load, cfg.seed * 1000 + k)
            res = summarize("disagg", "poisson", pt.load, run.records, run.duration_s)
            _log(f"disagg poisson {pt.load:g} (sent at {res.sent_rate:.2f}/s): "
                 f"{res.output_tok_s:.1f} out tok/s, TTFT mean "
                 f"{res.ttft.mean:.1f} ms, {res.failed} failed"
                 + (f" ({'; '.join(res.errors)})" if res.errors else ""))
            results.append(res)
        prefix = await run_prefix(client, cfg, vocab) if cfg.prefix_requests else None
    return results, prefix


async def run_prefix(client, cfg: ServeConfig, vocab: int) -> PrefixResult:
    warmup, cold, warm = prefix_requests(cfg, vocab)
    await sequential(client, warmup)
    cold_recs, warm_recs = [], []
    # Alternate, so drift in machine load hits both sides alike.
    for i in range(len(cold)):
        cold_recs.append(await one_request(client, cold.prompts[i], cold.output_lens[i]))
        warm_recs.append(await one_request(client, warm.prompts[i], warm.output_lens[i]))
    c = summarize("disagg", "prefix-cold", 1, cold_recs, 1.0)
    w = summarize("disagg", "prefix-warm", 1, warm_recs, 1.0)
    if c.failed or w.failed:
        raise RuntimeError(f"shared-prefix phase: {c.failed} cold and {w.failed} warm requests "
                           f"failed: {'; '.join(c.errors + w.errors)}")
    res = PrefixResult(cfg.prefix_len, cfg.unique_len, cfg.prefix_output_len, len(cold),
                       c.ttft, w.ttft, c.mean_cached_tokens, w.mean_cached_tokens,
                       w.ttft.mean / c.ttft.mean, c.breakdown_ms, w.breakdown_ms)
    _log(f"shared prefix: TTFT cold {c.ttft.mean:.1f} ms, warm {w.ttft.mean:.1f} ms")
    return res


# --- the benchmark ------------------------------------------------------------------------
def run(cfg: ServeConfig) -> ServeReport:
    import torch

    from engine import LLM
    from engine.config import DEFAULT_MAX_NUM_BATCHED_TOKENS
    from engine.model_config import ModelConfig
    from engine.presets import resolve_model
    from router.launcher import ClusterSpec

    vocab = ModelConfig.from_pretrained(resolve_model(cfg.model)).vocab_size
    tok = [] if cfg.tokenizer is None else ["--tokenizer", cfg.tokenizer]
    stream = ["--decode-stream", cfg.decode_stream, "--stream-interval", str(cfg.stream_interval),
              *tok]
    router_args = stream + ([] if cfg.max_local_prefill_length is None
                            else ["--max-local-prefill-length", str(cfg.max_local_prefill_length)])
    # Every worker of both clusters, and the in-process engine below, alike.
    worker_args = ["--num-gpu-blocks", str(cfg.num_gpu_blocks), *tok]
    if not cfg.partial_block_hits:
        worker_args.append("--no-enable-partial-block-hits")
    spec = ClusterSpec(model=cfg.model, num_prefill=cfg.num_prefill, num_decode=cfg.num_decode,
                       worker_args=worker_args, router_args=router_args,
                       share_cores=cfg.share_cores, engine_process=cfg.engine_process)
    agg_spec = ClusterSpec(model=cfg.model, num_prefill=0, num_decode=1, worker_args=worker_args,
                           router_args=stream, share_cores=cfg.share_cores,
                           engine_process=cfg.engine_process)
    # The report says what ran: workers on GPUs share no cores, whatever was asked.
    cfg = dataclasses.replace(cfg, share_cores=spec.cores_shared)
    rounds = ([[pt for pt in plan_points(cfg, vocab, r) if pt.mode == "concurrency"]
               for r in range(cfg.rounds)] if cfg.concurrency else [])
    open_points = [(k, pt) for k, pt in enumerate(plan_points(cfg, vocab))
                   if pt.mode == "poisson"]
    runs: dict[tuple[str, float], list[LoadRun]] = defaultdict(list)
    with contextlib.ExitStack() as stack:
        _log(f"starting a cluster: {cfg.num_prefill} prefill + {cfg.num_decode} decode, "
             f"{cfg.model}")
        disagg = stack.enter_context(quiet_cluster(spec))
        # The report says what ran: the launcher's choice where the run left it the choice.
        cfg = dataclasses.replace(cfg, engine_process=any(
            "--engine-process" in p.args for p in disagg.procs))
        runners: dict[str, Runner] = {"disagg": _cluster_runner(disagg)}
        if cfg.aggregated and rounds:
            _log("starting an aggregated cluster: 1 decode worker prefilling itself")
            runners["agg"] = _cluster_runner(stack.enter_context(quiet_cluster(agg_spec)))
        if cfg.inprocess and rounds:
            llm = stack.enter_context(LLM(cfg.model, tokenizer=cfg.tokenizer,
                                          num_gpu_blocks=cfg.num_gpu_blocks,
                                          enable_partial_block_hits=cfg.partial_block_hits))
            runners["inprocess"] = _inprocess_runner(llm.engine, cfg.stream_interval)
        for r, points in enumerate(rounds):
            for system in (list(runners) if r % 2 == 0 else list(reversed(runners))):
                for pt, load_run in runners[system](points):
                    runs[(system, pt.load)].append(load_run)
                    _log_round(r, cfg.rounds, system, pt, load_run)
        open_results, prefix = asyncio.run(_open_loops_and_prefix(
            disagg.router_address, cfg, open_points, vocab))
    points = _pooled(runs, "disagg") + open_results + _pooled(runs, "agg") \
        + _pooled(runs, "inprocess")
    per_round = {key: [_tok_s(x) for x in xs] for key, xs in runs.items()}
    return ServeReport(cfg, torch.get_num_threads(),
                       int(spec.worker_env()["OMP_NUM_THREADS"]),
                       int(agg_spec.worker_env()["OMP_NUM_THREADS"]), spec.step_budget("prefill"),
                       DEFAULT_MAX_NUM_BATCHED_TOKENS, agg_spec.step_budget("decode"),
                       os.cpu_count() or 0, os.environ.get(GRPC_EXPERIMENTS, ""), points,
                       throughput_ratios(points, per_round), prefix)


def _tok_s(run: LoadRun) -> float:
    return summarize("", "", 0, run.records, run.duration_s).output_tok_s


def _log_round(r: int, num_rounds: int, system: str, pt: Point, run: LoadRun) -> None:
    res = summarize(system, pt.mode, pt.load, run.records, run.duration_s)
    _log(f"round {r + 1}/{num_rounds} {system} concurrency {pt.load:g}: "
         f"{res.output_tok_s:.1f} out tok/s, TTFT mean {res.ttft.mean:.1f} ms, "
         f"{res.failed} failed" + (f" ({'; '.join(res.errors)})" if res.errors else ""))


def _pooled(runs: dict[tuple[str, float], list[LoadRun]], system: str) -> list[PointResult]:
    """One result per concurrency: every round's requests, over the rounds' summed time."""
    out = []
    for (name, load), xs in runs.items():
        if name != system:
            continue
        res = summarize(system, "concurrency", load, [rec for x in xs for rec in x.records],
                        sum(x.duration_s for x in xs))
        cpu = CPUShare.pooled([x.cpu for x in xs])
        if cpu is not None:
            res.cpu_cores = {"machine": cpu.machine_cores} | cpu.cores
        out.append(res)
    return out


@contextlib.contextmanager
def quiet_cluster(spec) -> Iterator:
    """A started ``Cluster(spec)`` whose services print to stderr, not the report's stdout."""
    from router.launcher import Cluster

    cluster = Cluster(spec)
    with services_print_to_stderr():
        cluster.start()
    try:
        yield cluster
    finally:
        cluster.stop()


@contextlib.contextmanager
def services_print_to_stderr():
    """The services print to the stdout they inherit; the bench's stdout is for the report
    alone (``--json`` promises one object)."""
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    try:
        yield
    finally:
        os.dup2(saved, 1)
        os.close(saved)
