"""The committed gRPC modules are exactly what `python -m hybrid_pd.proto.generate` makes."""

from pathlib import Path

from hybrid_pd.proto.generate import PROTO_DIR, PROTOS, generate


def test_generated_modules_are_fresh(tmp_path: Path) -> None:
    made = generate(tmp_path)
    assert {p.name for p in made} == {
        f"{proto.stem}{suffix}.py" for proto in PROTOS for suffix in ("_pb2", "_pb2_grpc")
    }
    for fresh in made:
        committed = PROTO_DIR / fresh.name
        assert committed.exists(), f"{fresh.name} missing: run python -m hybrid_pd.proto.generate"
        assert committed.read_bytes() == fresh.read_bytes(), (
            f"{fresh.name} is stale: run python -m hybrid_pd.proto.generate"
        )
