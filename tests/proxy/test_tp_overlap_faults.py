"""A tensor-parallel rank dies during an overlapped (staged) hand-over, with real worker
processes behind a proxy that overlaps: the rank's worker stops (exit 70), every request is
still answered with exactly the tokens of one engine, and no surviving worker keeps a block.

- A TP-2 prefill worker loses its follower while it prefills long prompts and the decode
  worker already pulls their final blocks: the proxy drops the staged legs (the decode
  worker frees what it staged) and prefills again on the other prefill worker.
- A TP-2 decode worker loses its follower while it pulls staged blocks: the staged legs
  fail before a token of their own and ordinary decode legs on the other decode worker take
  the prefill's kept KV.
- A TP-2 prefill worker loses its follower while kept KV of finished prompts waits for a
  busy decode worker: the staged legs waiting for it fail, and the legs that replace them
  recompute on the decode worker.

The first two run with pulls read by the decode worker (one-sided, the default) and sent
by the prefill worker (two-sided). Every worker has two ranks and the reference is an engine of
two ranks, as in test_tp_faults.py: between TP sizes the row-parallel sums add in another
order, which can move a near-tie (docs/architecture.md, "Tensor parallelism")."""

from __future__ import annotations

import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from hybrid_pd.connector.onesided import ENV as ONESIDED_ENV
from hybrid_pd.engine.sampling import SamplingParams
from hybrid_pd.launcher.local import start_worker
from hybrid_pd.proxy.worker_client import WorkerClient
from tests.connector.pd_fixtures import tp_layout
from tests.engine.test_tp import tp_tokens
from tests.proxy.conftest import KV_MEMORY, assert_no_leaks, make_proxy
from tests.proxy.test_failures import metric
from tests.proxy.test_resilience import body_for, prompt
from tests.proxy.test_tp_faults import _children, _cmdline

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

CHUNK = "32"  # the prefill workers' step: a prompt of PROMPT_LEN takes a dozen
PROMPT_LEN = 384
N_NEW = 12
SLOW = "0.25"  # seconds added to each step of a staged prefill: 3 s or more a prompt


class TPFleet:
    """TP-2 worker processes this module started (stopped at the end, killed by tests)."""

    def __init__(self, tiny_path, cache_dir, one_sided: bool = True) -> None:
        """`one_sided`: every worker reads staged and final pulls itself (the default),
        else the prefill worker sends them (two-sided)."""
        self.tiny_path, self.cache_dir = tiny_path, cache_dir
        self.one_sided = one_sided
        self.env = {"HYBRID_PD_CACHE": str(cache_dir), ONESIDED_ENV: "1" if one_sided else "0"}
        self.procs = []

    def start_all(
        self, *specs: tuple[str, int], decode_kv_memory: str = KV_MEMORY, slow: str = SLOW
    ) -> list:
        """One worker per (role, TP size), side by side; prefill workers step CHUNK tokens
        at a time, each step `slow` seconds longer while a decode leg follows them.
        `decode_kv_memory`: each decode rank's pool."""

        def one(role: str, tp: int):
            memory = decode_kv_memory if role == "decode" else KV_MEMORY
            args = ["--model", str(self.tiny_path), "--kv-memory", memory, "--threads", "1"]
            env = dict(self.env)
            if role == "prefill":
                args += ["--max-num-batched-tokens", CHUNK]
                env["HYBRID_PD_INJECT_FAULT"] = f"slow_prefill:{slow}"
            tp_args = ("--tensor-parallel-size", str(tp))
            return start_worker(role, *args, *tp_args, env=env, timeout=120)

        with ThreadPoolExecutor(len(specs)) as ex:
            starts = [ex.submit(one, *spec) for spec in specs]
        self.procs += [f.result() for f in starts if f.exception() is None]
        for f in starts:
            if f.exception() is not None:
                raise f.exception()
        return [f.result() for f in starts]

    def close(self) -> None:
        for p in self.procs:
            if p.proc.poll() is None:
                p.proc.terminate()
        for p in self.procs:
            p.stop()


@pytest.fixture
def fleet(request, tiny_path, cache_dir):
    """A TPFleet, one-sided unless the test's `one_sided` parameter says otherwise."""
    f = TPFleet(tiny_path, cache_dir, one_sided=getattr(request, "param", True))
    yield f
    f.close()


ONE_AND_TWO_SIDED = pytest.mark.parametrize(
    "fleet", [True, False], ids=["one-sided", "two-sided"], indirect=True
)


def stats_of(worker) -> dict:
    """The worker's Stats."""
    client = WorkerClient(worker.address, timeout_s=5)
    try:
        return client.stats()
    finally:
        client.close()


def assert_pulled_as_asked(fleet: TPFleet, prefill) -> None:
    """The prefill worker's pulls went the way the fleet asked: read by decode (confirmed
    here) or sent from here."""
    stats = stats_of(prefill)["prefill_connector"]
    assert stats["pulled"] > 0, stats
    if fleet.one_sided:
        assert stats["read_pulls"] == stats["pulled"] + stats["staged_pulls"], stats
    else:
        assert stats["read_pulls"] == 0 and stats["messages_sent"] > 0, stats


def follower(worker) -> int:
    """The pid of a TP-2 worker's one follower rank."""
    ranks = [c for c in _children(worker.proc.pid) if "tp_ranks" in _cmdline(c)]
    assert len(ranks) == 1, f"a TP-2 worker should have one follower rank: {ranks}"
    return ranks[0]


def post_all(url: str, prompts: list[list[int]], n_new: int = N_NEW):
    """POST one completion per prompt (`n_new` tokens), each from its own thread: (threads,
    results), where results[i] becomes prompt i's response (or the exception its post
    raised)."""
    results: list = [None] * len(prompts)

    def run(i: int) -> None:
        try:
            with httpx.Client(base_url=url, timeout=180) as c:
                results[i] = c.post("/v1/completions", json=body_for(prompts[i], n_new))
        except Exception as e:  # reported by the assertions on results
            results[i] = e

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(len(prompts))]
    for t in threads:
        t.start()
    return threads, results


def answers(threads, results) -> list[list[int]]:
    """Every request's token ids, once each thread is done (each answered 200)."""
    for t in threads:
        t.join(180)
        assert not t.is_alive(), "a request was never answered"
    bad = [r if isinstance(r, Exception) else r.text for r in results if
           isinstance(r, Exception) or r.status_code != 200]  # fmt: skip
    assert bad == [], bad
    return [r.json()["choices"][0]["token_ids"] for r in results]


def assert_tokens_equal(got: list[list[int]], want: list[list[int]]) -> None:
    """Every answer equal to its reference; else where each first differs."""
    assert got == want, [
        next((j for j, (a, b) in enumerate(zip(g, w, strict=False)) if a != b), None)
        for g, w in zip(got, want, strict=True)
    ]


def staged_pulls(worker, side: str) -> int:
    """Staged pulls the worker counted (`side`: "prefill" or "decode"); -1 if it is gone."""
    try:
        return stats_of(worker)[f"{side}_connector"]["staged_pulls"]
    except Exception:  # gone or going: not a worker to pick
        return -1


@pytest.mark.parametrize(
    ("fleet", "other_tp"),
    [(True, 2), (False, 2), (True, 1)],
    ids=["one-sided", "two-sided", "other-tp1"],
    indirect=["fleet"],
)
def test_prefill_rank_killed_while_staged_retries_elsewhere(fleet, other_tp, tiny_path, reference):
    """Two prefill workers (TP 2 and `other_tp`) and a TP-2 decode worker, overlapped. Once
    a TP-2 prefill worker has served staged pulls and still prefills (the proxy waits for
    its reply), its follower rank is killed: the worker exits 70, its prefills are retried
    on the other prefill worker, and every answer equals a TP-2 engine's. The decode
    worker, which had staged blocks of the dead worker's prompts, ends with every block
    free, as does the survivor. With `other_tp` 1 the retried prompts are handed over from
    one rank to two (another plan than the dead worker's); this checkpoint's tokens for
    these prompts are the same at TP 1 and TP 2, which the test checks first."""
    pre_a, pre_b, dec = fleet.start_all(("prefill", 2), ("prefill", other_tp), ("decode", 2))
    proxy = make_proxy(
        tiny_path,
        prefill_addresses=(pre_a.address, pre_b.address),
        decode_addresses=(dec.address,),
        overlap_transfer=True,
    )
    prompts = [prompt(500 + i, PROMPT_LEN) for i in range(3)]
    want = tp_tokens(tiny_path, 2, [prompts], N_NEW, max_batched_tokens=2048)["tokens"][0]
    assert len({t for w in want for t in w}) >= 8, "reference output does not vary"
    if other_tp == 1:
        params = SamplingParams(max_tokens=N_NEW, ignore_eos=True)
        assert [o.token_ids for o in reference.generate(prompts, params)] == want
    prefills = {pre_a.address: pre_a, pre_b.address: pre_b}
    if other_tp != 2:
        prefills.pop(pre_b.address)  # only a TP-2 worker has a follower rank to kill
    try:
        threads, results = post_all(proxy.url, prompts)
        deadline = time.monotonic() + 90
        victim = None
        while victim is None:
            assert time.monotonic() < deadline, "no prefill worker served a staged pull"
            assert any(t.is_alive() for t in threads), "every request ended before staging"
            time.sleep(0.05)
            busy = [w["address"] for w in proxy.pool.snapshot() if w["outstanding_prefills"]]
            for address in busy:
                if address in prefills and staged_pulls(prefills[address], "prefill") > 0:
                    victim = prefills[address]
                    break
        held = stats_of(dec)
        staged_before = held["decode_connector"]["staged_pulls"]
        assert staged_before > 0, "the decode worker staged nothing"
        # it holds blocks for the staged loads, those of the victim's prompts among them
        assert held["kv_requests"] >= 1 and held["free_blocks"] < held["num_blocks"] - 1
        doomed = follower(victim)
        os.kill(doomed, signal.SIGKILL)
        got = answers(threads, results)
        assert_tokens_equal(got, want)
        text = httpx.get(proxy.url + "/metrics").text
        # a prefill was in flight on the victim when it died, and was run again
        lost = sum(
            metric(text, f'hybrid_pd_proxy_failures_total{{kind="{k}"}}')
            for k in ("prefill_unavailable", "prefill_error")
        )
        assert lost >= 1, text
        assert metric(text, 'hybrid_pd_proxy_failures_total{kind="prefill_fallback"}') == 0
        assert metric(text, 'hybrid_pd_proxy_kv_transfers_total{result="pulled"}') == 3
        assert metric(text, 'hybrid_pd_proxy_kv_transfers_total{result="recomputed"}') == 0
    finally:
        proxy.stop()
        proxy.pool.close()
    assert victim.proc.wait(timeout=30) == 70  # the worker went down with its rank
    survivor = pre_b if victim is pre_a else pre_a
    assert_no_leaks([survivor, dec])
    assert_pulled_as_asked(fleet, survivor)
    assert staged_pulls(dec, "decode") >= staged_before


@ONE_AND_TWO_SIDED
def test_decode_rank_killed_while_staging_hands_over_to_another(fleet, tiny_path):
    """A TP-2 prefill worker and two TP-2 decode workers, overlapped. Once a decode worker
    has staged pulls and the prompts still prefill, its follower rank is killed: the worker
    exits 70, its staged legs fail before a token of their own, and ordinary decode legs
    on the other decode worker take the prefill's kept KV. Every answer equals a TP-2
    engine's; the prefill worker and the surviving decode worker keep nothing."""
    pre, dec_a, dec_b = fleet.start_all(("prefill", 2), ("decode", 2), ("decode", 2))
    proxy = make_proxy(
        tiny_path,
        prefill_addresses=(pre.address,),
        decode_addresses=(dec_a.address, dec_b.address),
        overlap_transfer=True,
    )
    prompts = [prompt(600 + i, PROMPT_LEN) for i in range(3)]
    want = tp_tokens(tiny_path, 2, [prompts], N_NEW, max_batched_tokens=2048)["tokens"][0]
    assert len({t for w in want for t in w}) >= 8, "reference output does not vary"
    decodes = {dec_a.address: dec_a, dec_b.address: dec_b}
    try:
        threads, results = post_all(proxy.url, prompts)
        deadline = time.monotonic() + 90
        victim = None
        while victim is None:
            assert time.monotonic() < deadline, "no decode worker staged a pull"
            assert any(t.is_alive() for t in threads), "every request ended before staging"
            time.sleep(0.05)
            snap = {w["address"]: w for w in proxy.pool.snapshot()}
            if not snap[pre.address]["outstanding_prefills"]:
                continue
            for address, worker in decodes.items():
                if snap[address]["outstanding_decodes"] and staged_pulls(worker, "decode") > 0:
                    victim = worker
                    break
        os.kill(follower(victim), signal.SIGKILL)
        got = answers(threads, results)
        assert_tokens_equal(got, want)
        text = httpx.get(proxy.url + "/metrics").text
        # a staged leg was on the victim, and an ordinary leg took its place
        assert metric(text, 'hybrid_pd_proxy_failures_total{kind="staged_fallback"}') >= 1
        # the survivor pulled the prefill's kept KV (nothing recomputed)
        assert metric(text, 'hybrid_pd_proxy_kv_transfers_total{result="pulled"}') == 3
        assert metric(text, 'hybrid_pd_proxy_kv_transfers_total{result="recomputed"}') == 0
    finally:
        proxy.stop()
        proxy.pool.close()
    assert victim.proc.wait(timeout=30) == 70  # the worker went down with its rank
    survivor = dec_b if victim is dec_a else dec_a
    assert_no_leaks([pre, survivor])
    assert_pulled_as_asked(fleet, pre)


def test_prefill_rank_killed_with_kept_kv_unpulled_recomputes(fleet, tiny_path, reference):
    """A TP-2 prefill worker (not slowed) and a TP-2 decode worker whose pool holds one
    request at a time, overlapped: the prompts' staged loads take turns, so prompts the
    prefill worker has finished wait there, kept, while decode serves another. Then the
    prefill worker's follower is killed: a waiting staged leg fails before a token of its
    own, the ordinary leg that replaces it cannot pull from the dead worker and recomputes
    prompt + first token on the decode worker. Every answer equals a TP-2 engine's; the
    decode worker ends with every block free."""
    n_new = 150  # each request holds the decode worker a while: the kept KV waits
    page = tp_layout(tiny_path, reference.kv_config, 2).page_size_bytes
    pre, dec = fleet.start_all(
        ("prefill", 2), ("decode", 2), decode_kv_memory=str(page * 18), slow="0"
    )
    assert stats_of(dec)["num_blocks"] == 18  # room for one prompt of PROMPT_LEN + n_new
    proxy = make_proxy(
        tiny_path,
        prefill_addresses=(pre.address,),
        decode_addresses=(dec.address,),
        overlap_transfer=True,
    )
    prompts = [prompt(800 + i, PROMPT_LEN) for i in range(3)]
    want = tp_tokens(tiny_path, 2, [prompts], n_new, max_batched_tokens=2048)["tokens"][0]
    assert len({t for w in want for t in w}) >= 8, "reference output does not vary"
    try:
        threads, results = post_all(proxy.url, prompts, n_new)
        deadline = time.monotonic() + 90
        while True:  # every prefill answered, and some kept KV not yet pulled
            assert time.monotonic() < deadline, "no kept KV waited for the decode worker"
            assert any(t.is_alive() for t in threads), "every request ended before the kill"
            time.sleep(0.02)
            snap = {w["address"]: w for w in proxy.pool.snapshot()}
            if snap[pre.address]["outstanding_prefills"] == 0 and stats_of(pre)["leases"] > 0:
                break
        os.kill(follower(pre), signal.SIGKILL)
        got = answers(threads, results)
        assert_tokens_equal(got, want)
        text = httpx.get(proxy.url + "/metrics").text
        assert metric(text, 'hybrid_pd_proxy_failures_total{kind="staged_fallback"}') >= 1
        assert metric(text, 'hybrid_pd_proxy_kv_transfers_total{result="recomputed"}') >= 1
    finally:
        proxy.stop()
        proxy.pool.close()
    assert pre.proc.wait(timeout=30) == 70  # the worker went down with its rank
    assert_no_leaks([dec])
