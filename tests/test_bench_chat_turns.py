"""``pdserve bench chat_turns``: argument checks, and a tiny run through real clusters (where
turn 2 ran and what it found cached; no timing asserts)."""
from __future__ import annotations

import argparse
import json

import pytest

from bench import chat_turns
from engine.cli import main as cli_main


@pytest.mark.parametrize("argv", [["--chats", "0"], ["--rounds", "0"], ["--new-len", "0"],
                                  ["--prompt-len", "4000"]])
def test_bad_arguments_are_refused(argv):
    p = argparse.ArgumentParser()
    chat_turns.add_args(p)
    with pytest.raises(ValueError):
        chat_turns.main(p.parse_args(argv))


@pytest.mark.slow  # ~33 s; the routing itself: tests/test_serving_cluster.py (a chat's next turn)
def test_turn_two_runs_on_the_decode_worker_only_with_reuse_on(capsys):
    assert cli_main(["bench", "chat_turns", "--chats", "2", "--rounds", "1", "--prompt-len",
                     "80", "--reply-len", "100", "--new-len", "10", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    runs = {run["setting"]: run for run in r["runs"]}
    assert set(runs) == {"reuse", "off"}
    # 80 + 100 tokens, 179 of them with K/V after the reply: 11 whole blocks on the decode
    # worker; the prefill worker holds turn 1's 5.
    assert runs["reuse"]["local"] == 2 and runs["reuse"]["cached_tokens"] == [176, 176]
    assert runs["off"]["local"] == 0 and runs["off"]["cached_tokens"] == [80, 80]
    assert all(t > 0 for run in r["runs"] for t in run["ttft_ms"])
    assert r["ratio"] > 0
