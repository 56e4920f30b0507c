"""``pdserve bench soak``: its counting on a stand-in client, argument checks, and a short run
end to end through a real cluster (counts and parity only; no timing asserts)."""
from __future__ import annotations

import argparse
import asyncio
import json

import pytest

from bench import soak
from bench.soak import MemorySample, SoakReport, Traffic
from client.errors import UnavailableError
from client.types import GenerationChunk


def _args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    soak.add_args(p)
    return p.parse_args(list(argv))


@pytest.mark.parametrize("argv", [["--duration", "0"], ["--concurrency", "0"],
                                  ["--cancel-fraction", "1.5"], ["--num-prefill", "-1"],
                                  ["--sample-every", "-1"], ["--pool-candidates", "0"]])
def test_bad_arguments_are_refused(argv):
    with pytest.raises(ValueError):
        soak.main(_args(*argv))


class _Client:
    """Streams ``tokens`` one chunk each, or raises ``error`` after them."""

    def __init__(self, tokens: list[int], error: Exception | None = None) -> None:
        self.tokens, self.error = tokens, error

    async def generate(self, prompt, **sampling):
        for t in self.tokens[:sampling["max_tokens"]]:
            yield GenerationChunk(request_id="r", index=0, text="", token_ids=[t])
        if self.error is not None:
            raise self.error


def _outcome(client: _Client, cancel: float = 0.0) -> SoakReport:
    report = SoakReport(1.0, 1)
    traffic = Traffic(_args("--max-tokens", "6", "--cancel-fraction", str(cancel)),
                      [([1, 2, 3], [7, 8, 9, 10, 11, 12])], report)
    for _ in range(20):
        asyncio.run(traffic.one(client))
    return report


def test_each_request_counts_once_by_how_it_ended():
    assert _outcome(_Client([7, 8, 9, 10, 11, 12])).finished == 20
    wrong = _outcome(_Client([7, 8, 0, 10, 11, 12]))
    assert wrong.wrong > 0 and "token 2 differs" in wrong.mismatches[0]
    failed = _outcome(_Client([7], UnavailableError("gone")))
    assert failed.failed == 20 and failed.errors[0] == "UnavailableError: gone"
    cut = _outcome(_Client([7, 8, 9, 10, 11, 12]), cancel=1.0)
    assert cut.cancelled == 20 and cut.finished == 0


def test_growth_is_measured_from_the_second_sample():
    r = SoakReport(3.0, 1, samples=[MemorySample(0, 0, {"router": 80}),
                                    MemorySample(1, 5, {"router": 90}),
                                    MemorySample(2, 9, {"router": 95})])
    assert r.growth_mb() == {"router": 5}
    assert "router +5" in soak.format_report(r)
    assert SoakReport(1.0, 1, samples=r.samples[:2]).growth_mb() == {}


# The slow tier (9 s): a benchmark's run; what it checks, the tokens against the engine under
# cancels, the serving tests and fuzzers check on every run.
@pytest.mark.slow
def test_a_short_soak_through_a_cluster(capsys):
    rc = soak.main(_args("--duration", "2.5", "--concurrency", "3", "--sample-every", "0.5",
                         "--max-tokens", "8", "--pool-candidates", "16", "--cancel-fraction",
                         "0.3", "--model", "micro-llama", "--json"))
    report = json.loads(capsys.readouterr().out)
    assert rc == 0
    assert report["finished"] > 0 and report["cancelled"] > 0
    assert report["wrong"] == 0 and report["failed"] == 0
    assert len(report["samples"]) >= 3
    services = report["samples"][-1]["rss_mb"]
    assert {n.split("-")[0] for n in services} == {"prefill", "decode", "router"}
    assert all(mb > 0 for s in report["samples"] for mb in s["rss_mb"].values())
