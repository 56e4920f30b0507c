"""Services freeze their startup heap (engine/gc_policy.py): full collections skip it, objects
created later are still collected, and the process exits without leak reports."""
from __future__ import annotations

import subprocess
import sys
import textwrap


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                          text=True, timeout=120)


def test_the_startup_heap_leaves_the_collected_generations():
    proc = _run("""
        import gc
        from engine.gc_policy import freeze_startup_heap
        # Lists: the collector tracks them (a dict of plain values it may not).
        startup = [[i] for i in range(50_000)]
        frozen = freeze_startup_heap()
        assert frozen >= 50_000, frozen
        tracked = {id(o) for o in gc.get_objects()}
        assert not any(id(o) in tracked for o in startup)
        # What serving creates afterwards is still collected, cycles included.
        class Node: pass
        a, b = Node(), Node()
        a.other, b.other = b, a
        del a, b
        assert gc.collect() >= 2
        assert freeze_startup_heap() >= frozen  # again: idempotent, one exit hook
        print("ok")
    """)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "ok"


def test_a_frozen_heap_exits_without_leak_reports():
    # nanobind (Triton's bindings) reports objects still alive at interpreter exit, which a
    # heap left frozen would be.
    proc = _run("""
        import kernels, triton
        from engine.gc_policy import freeze_startup_heap
        freeze_startup_heap()
    """)
    assert proc.returncode == 0, proc.stderr
    assert "leaked" not in proc.stderr


def test_a_service_freezes_its_heap_once_started():
    proc = _run("""
        import asyncio, gc
        from engine.grpc_server import GrpcServer, ServerConfig, run, serve

        async def main():
            server = GrpcServer(ServerConfig(), ["pdserve.test.Nothing"])
            counts = {}

            async def started():
                counts["at_start"] = gc.get_freeze_count()

                async def stop_soon():
                    await asyncio.sleep(0.2)
                    counts["serving"] = gc.get_freeze_count()
                    server.stopping.set()
                asyncio.get_running_loop().create_task(stop_soon())

            await serve(server, lambda: 0, on_started=started)
            print(counts["at_start"], counts["serving"])

        run(main)
    """)
    assert proc.returncode == 0, proc.stderr
    at_start, serving = map(int, proc.stdout.split())
    assert at_start == 0 and serving > 10_000
