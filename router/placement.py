"""Where one attempt at a request runs: the prefill worker (by cached prefix and load), or a
decode worker that prefills the prompt itself (conditional disaggregation,
router/local_prefill.py): because no prefill worker is up, because the prompt is short and
the prefill workers busy, or because that decode worker holds more of the prompt (a chat's
next turn)."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import grpc

from router.config import RouterConfig
from router.directory import LOAD_COST_TOKENS, NoWorkerError, WorkerDirectory, WorkerHandle
from router.local_prefill import should_prefill_locally, should_reuse_decode_cache


def _nothing() -> None:
    pass


@dataclass(frozen=True)
class Placement:
    prefill: WorkerHandle | None  # None when no prefill worker was found (local prefill on)
    # The decode worker that prefills the prompt when ``local``; a remote prefill's decode
    # worker is chosen once the prompt is prefilled.
    decode: WorkerHandle | None
    local: bool
    # Prompt tokens cached where the prompt runs, as the index saw them: none for a local
    # prefill chosen without looking.
    matched: int
    # Prompt tokens the local decode worker holds, when chosen for them; 0 else.
    held: int
    # Ends the prefill worker's in-flight count, taken at its pick (a remote prefill; a no-op
    # else): the router's next pick counts this request there even before its call starts.
    release_prefill: Callable[[], None] = _nothing


class Placer:
    def __init__(self, config: RouterConfig, directory: WorkerDirectory) -> None:
        self.config = config
        self.directory = directory

    async def place(self, hashes: list[bytes], num_tokens: int, avoid: frozenset[str],
                    requested_len: int) -> Placement:
        """``hashes``: the prompt's block hashes; ``requested_len``: the length the client
        asked room for (0: none), checked once the workers are known."""
        prefill, matched = await self._pick_prefill(hashes, num_tokens, avoid)
        # Counted from its pick: the awaits below let other requests pick meanwhile.
        release = self.directory.hold_inflight(prefill) if prefill is not None \
            else _nothing
        try:
            self.directory.check_prompt_fits(num_tokens, requested_len)
            decode, held = await self._decode_cache_holder(hashes, num_tokens, avoid, matched)
            if decode is not None:
                release()
                return Placement(prefill, decode, True, held, held)
            decode = await self._local_candidate(num_tokens, avoid)
            local = self._prefill_locally(prefill, decode, num_tokens, matched)
        except BaseException:
            release()
            raise
        if local:
            release()
        return Placement(prefill, decode, local, 0 if local else matched, 0, release)

    def _prefill_locally(self, prefill: WorkerHandle | None, decode: WorkerHandle | None,
                         num_tokens: int, matched: int) -> bool:
        """Whether the decode worker runs the prompt itself."""
        if prefill is not None:
            # Not this request's own count, held since its pick: the threshold is on what
            # the worker already has (with it, threshold 1 sent every short prompt to the
            # decode worker while the prefill worker idled).
            return decode is not None and should_prefill_locally(
                self.config.local_prefill, num_tokens, matched, prefill.inflight - 1,
                decode.prefilling)
        # No prefill worker at all: a decode worker that may prefill keeps short prompts
        # served instead of failing every request.
        limit = self.config.local_prefill.max_local_prefill_length
        if decode is None:
            raise NoWorkerError(grpc.StatusCode.UNAVAILABLE, "no prefill worker is available, "
                                "nor a decode worker with room to prefill"
                                + self.directory.foreign_hint("prefill"))
        if num_tokens > limit:
            raise NoWorkerError(grpc.StatusCode.UNAVAILABLE,
                                f"no prefill worker is available, and the {num_tokens}-token "
                                "prompt is longer than a decode worker prefills itself "
                                f"(--max-local-prefill-length {limit})")
        return True

    async def _pick_prefill(self, hashes: list[bytes], num_tokens: int,
                            avoid: frozenset[str]) -> tuple[WorkerHandle | None, int]:
        """The prefill worker and its cached prefix length; (None, 0) when there is none but
        local prefill is on, so a decode worker may still take the prompt."""
        try:
            return await self.directory.pick_prefill(hashes, num_tokens, avoid)
        except NoWorkerError:
            if not self.config.local_prefill.enabled:
                raise
            return None, 0

    async def _decode_cache_holder(self, hashes: list[bytes], num_tokens: int,
                                   avoid: frozenset[str],
                                   prefill_cached: int) -> tuple[WorkerHandle | None, int]:
        """The decode worker that should prefill the prompt because it holds more of it, and
        its cached tokens; (None, 0) else."""
        cfg = self.config.local_prefill
        if (cfg.decode_prefix_reuse_min_tokens == 0
                or num_tokens - prefill_cached < cfg.decode_prefix_reuse_min_tokens):
            return None, 0  # no decode worker can lead by enough: spare the index a lookup
        holder, held = await self.directory.longest_decode_prefix(hashes, num_tokens, avoid)
        if holder is None or not should_reuse_decode_cache(
                cfg, num_tokens, held, prefill_cached, holder.prefilling, LOAD_COST_TOKENS):
            return None, 0
        return holder, held

    async def _local_candidate(self, num_tokens: int,
                               avoid: frozenset[str]) -> WorkerHandle | None:
        """The decode worker a local prefill would go to; None when local prefill is off or no
        decode worker has room (the remote path then reports that after its prefill)."""
        if not self.config.local_prefill.enabled:
            return None
        try:
            return await self.directory.pick_decode(num_tokens + 1, avoid)
        except NoWorkerError:
            return None
