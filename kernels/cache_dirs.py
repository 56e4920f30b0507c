"""Where pdserve keeps what it builds once per host: compiled kernels, generated presets,
tokenizer snapshots, linear-layer timings.

Each kind has a variable of its own that names its folder outright (compose points them at a
volume); otherwise it lives under ``$XDG_CACHE_HOME/pdserve`` (``~/.cache/pdserve`` when that is
unset), as other tools' caches do. Here, not in ``engine``, because ``kernels`` is the package
every other one may import.
"""
from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path


def pdserve_cache_dir(env_var: str, name: str, environ: Mapping[str, str] = os.environ) -> Path:
    """``$env_var`` (``~`` expanded), else ``$XDG_CACHE_HOME/pdserve/name``, else
    ``~/.cache/pdserve/name``. An empty variable counts as unset."""
    own = environ.get(env_var)
    if own:
        return Path(own).expanduser()
    # The XDG spec: a relative XDG_CACHE_HOME is invalid and is ignored.
    xdg = Path(environ.get("XDG_CACHE_HOME", "")).expanduser()  # "" reads as "."
    root = xdg if xdg.is_absolute() else Path.home() / ".cache"
    return root / "pdserve" / name
