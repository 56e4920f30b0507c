"""What an installed (non-editable) pdserve carries: a wheel holds a package's Python files
and only the other files its package-data names."""
from __future__ import annotations

import fnmatch
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_every_cpu_kernel_source_and_header_is_package_data():
    # A wheel without kernels/csrc/cpu_math.h compiled none of the kernels that include it:
    # the engine fell back to plain torch with only a log line to say so.
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())
    globs = data["tool"]["setuptools"]["package-data"]["kernels"]
    files = [p.relative_to(ROOT / "kernels").as_posix()
             for p in (ROOT / "kernels" / "csrc").iterdir() if p.is_file()]
    assert any(f.endswith(".h") for f in files) and any(f.endswith(".c") for f in files)
    missing = [f for f in files if not any(fnmatch.fnmatch(f, g) for g in globs)]
    assert missing == []
