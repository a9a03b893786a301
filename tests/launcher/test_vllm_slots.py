"""`serve --engine vllm`: what each vLLM worker slot is given. With a fixed host the decode
servers know their prefill peers before any server starts (so all start at once); with
"auto" (a cluster) they learn them from the prefill actors."""

from __future__ import annotations

import json

from hybrid_pd.launcher.serve_config import ServeConfig
from hybrid_pd.launcher.vllm_slots import vllm_slots as _vllm_slots


def _slots(tmp_path, **fields):
    (tmp_path / "config.json").write_text(json.dumps({"dtype": "bfloat16"}))
    config = ServeConfig(engine="vllm", model=str(tmp_path), vllm_python="python3", **fields)
    return _vllm_slots(config, str(tmp_path))


def test_embedded_decode_slots_know_every_prefill_control_address(tmp_path):
    slots = _slots(tmp_path, prefill=2, decode=2)
    ports = [slots[("prefill", i)]["control_port"] for i in range(2)]
    assert len(set(ports)) == 2 and all(p > 0 for p in ports)
    want = tuple(f"127.0.0.1:{p}" for p in ports)
    assert [slots[("decode", i)]["peers"] for i in range(2)] == [want, want]
    assert all("peers" not in slots[("prefill", i)] for i in range(2))
    assert {s["dtype"] for s in slots.values()} == {"bfloat16"}


def test_worker_host_is_the_peers_host(tmp_path):
    slots = _slots(tmp_path, worker_host="127.0.0.2", address="127.0.0.2:6379")
    port = slots[("prefill", 0)]["control_port"]
    assert slots[("decode", 0)]["peers"] == (f"127.0.0.2:{port}",)


def test_cluster_decode_slots_wait_for_the_prefill_actors(tmp_path):
    slots = _slots(tmp_path, address="127.0.0.2:6379")
    assert slots[("prefill", 0)]["host"] == "auto"
    assert "peers" not in slots[("decode", 0)]
