"""Regenerate the gRPC modules from the .proto files: `python -m hybrid_pd.proto.generate`.

The generated *_pb2.py / *_pb2_grpc.py files are committed; a test fails when they are stale.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

PROTO_DIR = Path(__file__).resolve().parent
ROOT = PROTO_DIR.parent.parent
PROTOS = sorted(PROTO_DIR.glob("*.proto"))


def generate(out_dir: Path) -> list[Path]:
    """Run protoc into `out_dir` (mirroring hybrid_pd/proto/); returns the written files."""
    from grpc_tools import protoc

    rel = [str(p.relative_to(ROOT)) for p in PROTOS]
    args = ["protoc", f"-I{ROOT}", f"--python_out={out_dir}", f"--grpc_python_out={out_dir}"]
    if protoc.main(args + rel) != 0:
        raise RuntimeError("protoc failed")
    return sorted((out_dir / "hybrid_pd" / "proto").glob("*_pb2*.py"))


def main() -> int:
    with tempfile.TemporaryDirectory() as tmp:
        for f in generate(Path(tmp)):
            (PROTO_DIR / f.name).write_bytes(f.read_bytes())
            print(f"wrote hybrid_pd/proto/{f.name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
