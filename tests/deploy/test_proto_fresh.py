"""The committed generated code in proto/batchd/v1/ is what proto/generate.py makes of the .proto files.

protoc runs in a subprocess (``python proto/generate.py OUT``): grpc_tools' protoc links its own
protobuf C++ runtime, and loaded into a process that has imported TensorFlow (``make bench``
installs it; tests/deploy/test_bench_imports.py imports the tf.data peer) the two clash and the
process dies of a segmentation fault.
"""

from __future__ import annotations

import difflib
import importlib.util
import pathlib
import subprocess
import sys

import pytest

pytestmark = pytest.mark.timeout(60)

REPO = pathlib.Path(__file__).resolve().parents[2]
GENERATED = REPO / "proto" / "batchd" / "v1"
FILES = ("loader_pb2.py", "loader_pb2.pyi", "loader_pb2_grpc.py")


def load_generate_module():
    spec = importlib.util.spec_from_file_location("batchd_proto_generate", REPO / "proto" / "generate.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def generate(out_dir: pathlib.Path) -> None:
    """proto/generate.py into ``out_dir``, in a process of its own (module docstring)."""
    done = subprocess.run([sys.executable, str(REPO / "proto" / "generate.py"), str(out_dir)], cwd=REPO,
                          capture_output=True, text=True, timeout=50)
    assert done.returncode == 0, f"proto/generate.py failed ({done.returncode}):\n{done.stdout}\n{done.stderr}"


def test_generated_code_is_fresh(tmp_path):
    gen = load_generate_module()
    assert (GENERATED / "loader.proto") in gen.proto_files()
    generate(tmp_path)
    stale = []
    for name in FILES:
        fresh = tmp_path / "batchd" / "v1" / name
        committed = GENERATED / name
        assert fresh.is_file(), f"generate() did not write {fresh.relative_to(tmp_path)}"
        if not committed.is_file():
            stale.append(f"{committed.relative_to(REPO)} is missing")
        elif committed.read_bytes() != fresh.read_bytes():
            diff = difflib.unified_diff(
                committed.read_text().splitlines(), fresh.read_text().splitlines(),
                f"committed/{name}", f"regenerated/{name}", lineterm="", n=1,
            )
            stale.append("\n".join(list(diff)[:40]))
    assert not stale, (
        "the generated code in proto/batchd/v1/ does not match loader.proto: run `make proto` "
        "(python proto/generate.py) and commit the result.\n\n" + "\n\n".join(stale)
    )


def test_generated_files_are_all_compared(tmp_path):
    # if the contract grows another .proto, this test must learn its files
    generate(tmp_path)
    written = sorted(p.name for p in (tmp_path / "batchd" / "v1").iterdir() if p.is_file())
    assert written == sorted(FILES)
