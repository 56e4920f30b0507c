"""Regenerates the Python code of the protos: ``python -m protos.generate [--out DIR]``.

The generated modules are committed; tests/test_protos.py regenerates them into a temporary
folder and fails if they differ, so a changed .proto cannot ship with stale code.
"""
from __future__ import annotations

import argparse
import pathlib
import sys

PROTOS_DIR = pathlib.Path(__file__).resolve().parent
REPO_ROOT = PROTOS_DIR.parent
PROTO_FILES = ("common.proto", "worker.proto", "router.proto")


def generate(out_dir: pathlib.Path) -> list[pathlib.Path]:
    """Writes ``protos/*_pb2.py``, ``*_pb2.pyi`` and ``*_pb2_grpc.py`` under ``out_dir``."""
    from grpc_tools import protoc
    import grpc_tools

    include = pathlib.Path(grpc_tools.__file__).parent / "_proto"
    out_dir.mkdir(parents=True, exist_ok=True)
    # Proto paths are relative to the repo root so the generated imports read
    # ``from protos import common_pb2``: the package the code lives in.
    args = ["grpc_tools.protoc", f"-I{REPO_ROOT}", f"-I{include}", f"--python_out={out_dir}",
            f"--pyi_out={out_dir}", f"--grpc_python_out={out_dir}"]
    args += [f"protos/{name}" for name in PROTO_FILES]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed on {', '.join(PROTO_FILES)}")
    return sorted((out_dir / "protos").glob("*_pb2*.py*"))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--out", type=pathlib.Path, default=REPO_ROOT,
                   help="folder that receives protos/*_pb2*.py (default: the repo root)")
    args = p.parse_args(argv)
    for path in generate(args.out):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
