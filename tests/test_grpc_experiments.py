"""pdserve's processes poll gRPC's sockets on grpc.aio's own thread
(engine/grpc_experiments.py)."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from engine.grpc_experiments import ENV, LEGACY_POLLER, apply_grpc_experiments
from tests.grpc_wakeups import MESSAGES

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")


def test_the_default_is_set_only_where_the_environment_has_none():
    env: dict[str, str] = {}
    assert apply_grpc_experiments(env) == LEGACY_POLLER and env == {ENV: LEGACY_POLLER}
    # A user's choice wins, an empty one (gRPC's own defaults) included.
    for mine in ("", "tcp_rcv_lowat", "-event_engine_client"):
        env = {ENV: mine}
        assert apply_grpc_experiments(env) == mine and env == {ENV: mine}


def _wakeups(mode: str, env: dict[str, str]) -> int:
    out = subprocess.run([sys.executable, "-m", "tests.grpc_wakeups", mode], env=env,
                         capture_output=True, text=True, timeout=120, check=True)
    return int(out.stdout.split()[-1])


def test_with_the_default_no_event_engine_thread_wakes_per_message():
    env = {k: v for k, v in os.environ.items() if k != ENV}
    # The control: with gRPC's own defaults, each message wakes the EventEngine's threads
    # (318-322 times for 100 messages with grpcio 1.85). If this fails, the installed gRPC no
    # longer moves bytes through them and the default may have nothing left to switch off.
    assert _wakeups("plain", {**env, ENV: ""}) >= 2 * MESSAGES
    # The default, applied as `pdserve` applies it: grpc.aio's own poller reads the sockets;
    # what still wakes them is timers (14-32 times here, more on a busy host).
    assert _wakeups("apply", env) < MESSAGES
