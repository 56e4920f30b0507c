"""A raw DecodeMany stream to a decode worker (tests): controls in, every event out."""
from __future__ import annotations

import asyncio

import grpc

from protos import common_pb2, worker_pb2, worker_pb2_grpc


def local_request(rid: str, prompt: list[int], max_tokens: int,
                  **fields) -> worker_pb2.DecodeRequest:
    return worker_pb2.DecodeRequest(
        request_id=rid, prompt_token_ids=prompt, local_prefill=True,
        sampling=common_pb2.SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                           ignore_eos=True), **fields)


def start(req: worker_pb2.DecodeRequest, timeout_s: float = 60.0) -> worker_pb2.DecodeControl:
    return worker_pb2.DecodeControl(start=worker_pb2.DecodeStart(request=req, timeout_s=timeout_s))


class DecodeStream:
    """A raw DecodeMany stream: controls in, every event out, grouped by request."""

    def __init__(self, address: str) -> None:
        self.channel = grpc.aio.insecure_channel(address)
        self.outbox: asyncio.Queue = asyncio.Queue()
        self.call = worker_pb2_grpc.DecodeWorkerStub(self.channel).DecodeMany(self._controls())
        self.batches: list[worker_pb2.DecodeBatch] = []
        self.by_rid: dict[str, list[worker_pb2.DecodeEvent]] = {}

    async def _controls(self):
        while (ctl := await self.outbox.get()) is not None:
            yield ctl

    def send(self, ctl: worker_pb2.DecodeControl) -> None:
        self.outbox.put_nowait(ctl)

    def close_sending(self) -> None:
        self.outbox.put_nowait(None)

    async def read_until(self, done) -> dict[str, list[worker_pb2.DecodeEvent]]:
        """Reads batches until ``done(events_by_request)`` or the stream's end; returns every
        event read so far, by request."""
        async for batch in self.call:
            self.batches.append(batch)
            for ev in batch.events:
                self.by_rid.setdefault(ev.request_id, []).append(ev)
            if done(self.by_rid):
                break
        return self.by_rid

    async def close(self) -> None:
        self.call.cancel()
        await self.channel.close()


def ended(events: list[worker_pb2.DecodeEvent]) -> bool:
    return bool(events) and (events[-1].HasField("error") or bool(events[-1].chunk.finish_reason))
