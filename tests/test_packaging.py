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


def test_the_declared_license_has_its_text_in_the_tree():
    # pyproject declares Apache-2.0; a wheel carries the files license-files names, and a
    # declared license without its text is not a grant anyone can rely on.
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert data["license"] == "Apache-2.0"
    for name in data["license-files"]:
        text = (ROOT / name).read_text()
        assert "Apache License" in text and "Version 2.0" in text
        assert "TERMS AND CONDITIONS FOR USE, REPRODUCTION, AND DISTRIBUTION" in text
