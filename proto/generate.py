"""Regenerate the Python code of the wire contract: ``python proto/generate.py [OUT_DIR]``.

The .proto files live under ``proto/batchd/v1/`` so that the generated modules import as
``batchd.v1.<name>_pb2`` without patching. With OUT_DIR the code is written there instead of
next to the .proto files (the freshness test compares the two).
"""

from __future__ import annotations

import pathlib
import sys

from grpc_tools import protoc

PROTO_ROOT = pathlib.Path(__file__).resolve().parent


def proto_files() -> list[pathlib.Path]:
    """The .proto files of the contract, sorted."""
    return sorted(PROTO_ROOT.glob("batchd/**/*.proto"))


def generate(out_dir: pathlib.Path = PROTO_ROOT) -> None:
    """Write ``*_pb2.py``, ``*_pb2.pyi`` and ``*_pb2_grpc.py`` for every proto file into out_dir.

    Raises RuntimeError if protoc reports an error.
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    args = [
        "grpc_tools.protoc",
        f"-I{PROTO_ROOT}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        *(str(p.relative_to(PROTO_ROOT)) for p in proto_files()),
    ]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed: {' '.join(args)}")


if __name__ == "__main__":
    generate(pathlib.Path(sys.argv[1]) if len(sys.argv) > 1 else PROTO_ROOT)
