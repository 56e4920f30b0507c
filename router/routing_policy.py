"""The routing policy: which worker takes a prompt.

Prefill: the best score ``cached_tokens - LOAD_COST_TOKENS * load``, where ``cached_tokens`` is
the longest prefix of the prompt the worker holds (from the Redis index) and ``load`` counts
requests queued there (its last heartbeat's waiting requests plus the router's own requests in
flight to it, which are fresher: counted from their pick, router/worker_handle.py). A cached
token saves its prefill; a queued request delays this one by roughly a prompt's prefill, hence
the exchange rate. Decode: among workers with enough free blocks for the prompt, the fewest
requests in flight, then the most free blocks; when no worker's last heartbeat shows enough,
the workers are asked for their current free blocks before the request is refused.

Ties: each router knows only its own requests in flight, and with one tie order shared by all
(the smaller id first), every router idle at once sent its next prompt to the same worker (two
routers with a request each: both on one prefill and one decode worker, the other two idle).
Router i of the R sharing the namespace (router/router_peers.py) ranks its W candidates by id
starting at the (i*W/R)-th, wrapping around, so routers spread over the workers; while it does
not know its place (Redis away since its start), the order is a hash of the worker ids drawn
from the router's id (``tie_seed``), independent of other routers'. Either way a router's own
routing is deterministic; a lone router, or a directory with neither, takes the smaller id
first.

Decode workers publish their cached blocks too: ``longest_decode_prefix`` finds the one
holding most of a prompt (a chat's next turn), which router/local_prefill.py may let prefill
it.
"""
from __future__ import annotations

import asyncio
import hashlib
import logging

import grpc

from protos import common_pb2
from router.worker_handle import WorkerHandle

logger = logging.getLogger(__name__)

LOAD_COST_TOKENS = 256
# A decode worker asked for its current info before a RESOURCE_EXHAUSTED refusal answers
# within this, or the refusal goes by its last heartbeat.
FRESH_INFO_TIMEOUT_S = 1.0


class NoWorkerError(Exception):
    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


class RoutingPolicy:
    """WorkerDirectory's picks, over its ``candidates`` and the registry's prefix index."""

    def tie_ranks(self, workers: list[WorkerHandle]) -> dict[str, tuple]:
        """Per worker id, where it comes among ``workers`` when they are equally good, the
        lowest first (the module's docstring says how)."""
        place = self.router_place() if self.router_place is not None else None
        ids = sorted(w.worker_id for w in workers)
        if place is not None:
            start = place.offset(len(ids))
            return {wid: ((i - start) % len(ids), wid) for i, wid in enumerate(ids)}
        if not self.tie_seed:
            return {wid: (0, wid) for wid in ids}
        return {wid: (0, hashlib.blake2b(f"{self.tie_seed}\0{wid}".encode(),
                                         digest_size=8).hexdigest()) for wid in ids}

    async def _candidates_now(self, role: str) -> list[WorkerHandle]:
        """Candidates, re-reading the registry when the cached view has none: a worker that
        registered since the last periodic refresh takes the request instead of a refusal."""
        cands = self.candidates(role)
        if not cands and await self.refresh_if_reachable():
            cands = self.candidates(role)
        return cands

    async def pick_prefill(self, block_hashes: list[bytes], num_tokens: int,
                           avoid: frozenset[str] = frozenset()) -> tuple[WorkerHandle, int]:
        """The prefill worker for a prompt, and how many of its tokens that worker has cached.
        Workers in ``avoid`` are taken only when no other is available."""
        cands = _prefer(await self._candidates_now("prefill"), avoid)
        if not cands:
            raise NoWorkerError(grpc.StatusCode.UNAVAILABLE,
                                "no prefill worker is available" + self.foreign_hint("prefill"))
        matched = await self._match_prefix(block_hashes, [w.worker_id for w in cands])
        ties = self.tie_ranks(cands)

        def rank(w: WorkerHandle) -> tuple:  # the best first
            cached = min(matched.get(w.worker_id, 0) * self.block_size, num_tokens)
            load = w.inflight + w.info.num_waiting
            return (LOAD_COST_TOKENS * load - cached, w.inflight, ties[w.worker_id])

        best = min(cands, key=rank)
        return best, min(matched.get(best.worker_id, 0) * self.block_size, num_tokens)

    async def _match_prefix(self, block_hashes: list[bytes],
                            worker_ids: list[str]) -> dict[str, int]:
        return await self._health.ask(
            "the prefix lookup", lambda: self.registry.match_prefix(block_hashes, worker_ids), {})

    async def longest_decode_prefix(self, block_hashes: list[bytes], num_tokens: int,
                                    avoid: frozenset[str]) -> tuple[WorkerHandle | None, int]:
        """The decode worker with room for the prompt that holds the longest prefix of it, and
        that prefix in tokens; (None, 0) when none holds any. Workers in ``avoid`` are left
        out: the prompt has somewhere else to go."""
        need = -(-(num_tokens + 1) // self.block_size)
        cands = [w for w in await self._candidates_now("decode")
                 if w.worker_id not in avoid and w.info.num_free_blocks >= need]
        if not cands or not block_hashes:
            return None, 0
        matched = await self._match_prefix(block_hashes, [w.worker_id for w in cands])
        ties = self.tie_ranks(cands)
        best = min(cands, key=lambda w: (-matched.get(w.worker_id, 0), w.inflight,
                                         ties[w.worker_id]))
        cached = min(matched.get(best.worker_id, 0) * self.block_size, num_tokens)
        return (best, cached) if cached else (None, 0)

    async def pick_decode(self, num_tokens: int,
                          avoid: frozenset[str] = frozenset()) -> WorkerHandle:
        """A decode worker with room for ``num_tokens``; of those, one not in ``avoid`` when
        there is one (an avoided worker with room beats a refusal)."""
        need = -(-num_tokens // self.block_size)
        cands = await self._candidates_now("decode")
        if not cands:
            raise NoWorkerError(grpc.StatusCode.UNAVAILABLE,
                                "no decode worker is available" + self.foreign_hint("decode"))
        roomy = [w for w in cands if w.info.num_free_blocks >= need]
        if not roomy:
            # The registry holds each worker's last heartbeat: blocks freed since then still
            # read as taken. Ask the workers themselves before refusing.
            await self._ask_fresh(cands)
            # Their answers may say draining (or another block size, after a restart at the
            # same address): such a worker refuses the request, however much room it has.
            cands = self.candidates("decode")
            if not cands:
                raise NoWorkerError(grpc.StatusCode.UNAVAILABLE, "no decode worker is "
                                    "available" + self.foreign_hint("decode"))
            roomy = [w for w in cands if w.info.num_free_blocks >= need]
        if not roomy:
            raise NoWorkerError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                f"no room on any decode worker: none has {need} free KV "
                                f"blocks")
        roomy = _prefer(roomy, avoid)
        ties = self.tie_ranks(roomy)
        return min(roomy, key=lambda w: (w.inflight, -w.info.num_free_blocks, ties[w.worker_id]))

    def foreign_hint(self, role: str) -> str:
        """Why none may be available though some are registered: they serve another model
        (router/model_match.py), or have another --block-size, whose blocks this router's
        hashes do not name. "" when none does."""
        why = []
        n = self.foreign_now.get(role, 0)
        if n:
            why.append(f"{n} registered {role} worker{'s' if n > 1 else ''} serve"
                       f"{'' if n > 1 else 's'} another model than this router's; its log says "
                       "how they differ")
        sizes = [w.info.block_size for w in self.workers.values()
                 if w.info.role == role and w.info.block_size != self.block_size]
        if sizes:
            n = len(sizes)
            named = ", ".join(str(b) for b in sorted(set(sizes)))
            why.append(f"{n} registered {role} worker{'s' if n > 1 else ''} ha"
                       f"{'ve' if n > 1 else 's'} --block-size {named}, not this router's "
                       f"{self.block_size}")
        return f" ({'; '.join(why)})" if why else ""

    async def _ask_fresh(self, workers: list[WorkerHandle]) -> None:
        """Each decode worker's own current info; one that does not answer keeps its view.
        Requests that need it at once (a burst waiting for room) share one call per worker."""
        def asking(w: WorkerHandle) -> asyncio.Future:
            if w.asking is None or w.asking.done():
                w.asking = asyncio.ensure_future(self._ask_info(w))
            return asyncio.shield(w.asking)  # one waiter's cancel leaves the others' call

        await asyncio.gather(*(asking(w) for w in workers))

    @staticmethod
    async def _ask_info(w: WorkerHandle) -> None:
        try:
            info = await w.decode_stub.GetWorkerInfo(common_pb2.WorkerInfoRequest(),
                                                     timeout=FRESH_INFO_TIMEOUT_S)
        except (grpc.aio.AioRpcError, grpc.aio.UsageError) as e:
            logger.warning("worker %s did not report its info: %s", w.worker_id,
                           e.code() if isinstance(e, grpc.aio.AioRpcError) else e)
            return
        if info.worker_id == w.worker_id and info.role == w.info.role:
            info.draining = info.draining or w.info.draining  # a drain set by an admin
            w.info = info



def _prefer(cands: list[WorkerHandle], avoid: frozenset[str]) -> list[WorkerHandle]:
    """The candidates not in ``avoid``, or all of them when that leaves none."""
    kept = [w for w in cands if w.worker_id not in avoid]
    return kept or cands
