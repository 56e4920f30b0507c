import os
from pathlib import Path

import pytest

# Built-in presets are generated once into a folder inside the checkout (git-ignored), so
# the suite never writes to the user's home and reruns skip generation.
os.environ.setdefault("PDSERVE_CACHE_DIR", str(Path(__file__).resolve().parent.parent
                                               / ".cache" / "test-models"))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def preset_path():
    from engine.presets import resolve_model

    return resolve_model
