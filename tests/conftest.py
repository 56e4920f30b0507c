import os
import sys
from pathlib import Path

import pytest

import kernels  # noqa: F401  (before torch: oneMKL's dispatch, see kernels/mkl_vendor.py)

pytest_plugins = ["tests.crash_witness"]

# The suite starts hundreds of Python processes (services, TP ranks, engine processes). Where
# PYTHONDONTWRITEBYTECODE is set (this CI machine's environment sets it), each one compiled the
# project's modules from source again: ~0.4 s of CPU apiece. The caches go to __pycache__
# folders in the checkout (git-ignored).
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
sys.dont_write_bytecode = False

# Built-in presets are generated once into a folder inside the checkout (git-ignored), so
# the suite never writes to the user's home and reruns skip generation.
os.environ.setdefault("PDSERVE_CACHE_DIR", str(Path(__file__).resolve().parent.parent
                                               / ".cache" / "test-models"))
# Tokenizer snapshots (engine/tokenizer_snapshot.py) likewise, for every process a test starts.
os.environ.setdefault("PDSERVE_TOKENIZER_CACHE", str(Path(__file__).resolve().parent.parent
                                                     / ".cache" / "test-tokenizers"))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Without a GPU the Triton kernels run under Triton's interpreter. Triton settles that when it
# is first imported, which any test may do first, so it is decided here, before all of them.
if "TRITON_INTERPRET" not in os.environ:
    import torch

    if not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"


@pytest.fixture
def kv_agents():
    """make(backend, layout=SMALL_LAYOUT, seed=None): an in-process KV agent over a zeroed
    cache (a seeded random one with ``seed``), closed after the test, last made first."""
    import torch

    from kvtransfer import make_agent
    from tests.kv_owner_proc import SMALL_LAYOUT, seeded_cache

    made = []

    def make(backend: str, layout=SMALL_LAYOUT, seed: int | None = None):
        cache = torch.zeros(layout.shape) if seed is None else seeded_cache(layout, seed)
        made.append(make_agent(backend, cache, layout))
        return made[-1]

    yield make
    for a in reversed(made):
        a.close()


@pytest.fixture(scope="session")
def preset_path():
    from engine.presets import resolve_model

    return resolve_model


@pytest.fixture(scope="module", autouse=True)
def _clusters_stopped():
    """Every cluster a module starts is stopped by its end: one that is not leaves its services'
    core-share folder behind (and, started for real, its processes)."""
    dirs = sys.modules.get("router.share_dirs")
    before = set(dirs.LIVE) if dirs is not None else set()
    yield
    dirs = sys.modules.get("router.share_dirs")
    left = set(dirs.LIVE) - before if dirs is not None else set()
    for path in left:
        dirs.remove(path)
    if left:
        pytest.fail(f"a cluster of this module was never stopped: its core-share folders "
                    f"{sorted(left)} were left")


@pytest.fixture(scope="module")
def redis_url():
    """A redis-server of the module's own, on a free port. Per module, not per session: modules
    flush it and count its keys, so none may see another's (a module that needs more, such as a
    Redis past its first second, wraps this under the same name)."""
    from router.redis_server import RedisServer

    with RedisServer() as server:
        yield server.url


@pytest.fixture(scope="module")
def reference(request):
    """The in-process engine the serving tests compare a cluster's output with: the module's
    MODEL (tests/serving_helpers.SERVING_MODEL), tiny-llama where it names none."""
    from engine import LLM

    with LLM(getattr(request.module, "MODEL", "tiny-llama"), num_gpu_blocks=256) as llm:
        yield llm

# CI runs must be reproducible: hypothesis explores a fixed set of examples unless a developer
# asks for another (HYPOTHESIS_PROFILE=explore, or pytest --hypothesis-profile=explore).
try:
    from hypothesis import settings

    settings.register_profile("ci", derandomize=True, deadline=None)
    settings.register_profile("explore", deadline=None)
    settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
except ImportError:  # hypothesis is a dev extra
    pass
