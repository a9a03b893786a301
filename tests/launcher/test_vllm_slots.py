"""`serve --engine vllm`: what each vLLM worker slot is given. With a fixed host the decode
servers know their prefill peers before any server starts (so all start at once); with
"auto" (a cluster) they learn them from the prefill actors."""

from __future__ import annotations

import json
import os
import socket

import pytest

from hybrid_pd.launcher.serve_config import ServeConfig
from hybrid_pd.launcher.vllm_slots import rank_binds
from hybrid_pd.launcher.vllm_slots import vllm_slots as _vllm_slots
from hybrid_pd.workers.vllm_server import free_port


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


def test_rank_binds_give_every_rank_its_own_cpus_where_there_are_enough():
    assert rank_binds(range(4), [2, 1]) == ["0|1", "2"]  # one CPU left over
    assert rank_binds(range(8), [2, 2]) == ["0,1|2,3", "4,5|6,7"]
    assert rank_binds([5, 7], [1]) == ["5,7"]


def test_rank_binds_on_fewer_cpus_than_ranks_never_pair_a_servers_own_ranks():
    # 3 ranks on 2 CPUs: decode's rank shares a CPU with a prefill rank, never its own
    assert rank_binds([0, 1], [2, 1]) == ["0|1", "0"]
    assert rank_binds([0, 1, 2], [2, 2]) == ["0|1", "2|0"]
    assert rank_binds([0, 1], [1, 1, 1]) == ["0", "1", "0"]
    for binds in (rank_binds([0, 1, 2], [3, 2, 1]), rank_binds([0, 1], [2, 2])):
        for bind in binds:
            ranks = bind.split("|")
            assert len(set(ranks)) == len(ranks)


def test_rank_binds_refuse_more_ranks_than_cpus_in_one_server():
    with pytest.raises(ValueError, match="tensor-parallel size 3 needs 3 CPUs on one node"):
        rank_binds([0, 1], [3], where="node 127.0.0.1")


def test_tp_slots_size_their_ranks_ports_and_peers(tmp_path):
    cpus = sorted(os.sched_getaffinity(0))
    slots = _slots(tmp_path, prefill_tensor_parallel_size=2, decode=1, prefill=2)
    sizes = [slots[k]["tensor_parallel_size"] for k in (("prefill", 0), ("prefill", 1))]
    assert sizes == [2, 2] and slots[("decode", 0)]["tensor_parallel_size"] == 1
    assert [slots[k]["cpus"] for k in (("prefill", 0), ("prefill", 1), ("decode", 0))] == (
        rank_binds(cpus, [2, 2, 1])
    )
    # each prefill server's connector serves ranks 0 and 1 on port and port + 1: the two
    # ranges are free now and apart; decode's peers name rank 0 of each
    ports = [slots[("prefill", i)]["control_port"] for i in range(2)]
    ranges = [set(range(p, p + 2)) for p in ports]
    assert not ranges[0] & ranges[1]
    for port in (p + k for p in ports for k in range(2)):
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))
    assert slots[("decode", 0)]["peers"] == tuple(f"127.0.0.1:{p}" for p in ports)


def test_tp_wider_than_this_hosts_cpus_is_refused_before_anything_starts(tmp_path):
    wide = len(os.sched_getaffinity(0)) + 1
    with pytest.raises(ValueError, match=f"tensor-parallel size {wide} needs {wide} CPUs"):
        _slots(tmp_path, decode_tensor_parallel_size=wide)


def test_free_port_span_is_consecutive_free_ports():
    port = free_port(span=3)
    for k in range(3):
        with socket.socket() as s:
            s.bind(("127.0.0.1", port + k))
    with pytest.raises(ValueError):
        free_port(span=0)
