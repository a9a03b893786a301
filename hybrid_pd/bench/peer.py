"""`hybrid-pd bench engine --peer vllm`: our engine and vLLM's offline engine on one checkpoint,
one run, alternating.

vLLM pins its own torch, so it runs in a child process under its own Python
(`peer_vllm`), loaded once and kept alive; the parent holds our engine. For every batch
size and repetition: ours, then vLLM, on the same prompt token ids (random ids below the
vocabulary, from a seed), so machine noise falls on both alike. Both sides use the same
timing (`peer_vllm.timed_steps`), the same dtype, the same number of CPU threads on the
same CPUs (vLLM through VLLM_CPU_OMP_THREADS_BIND, ours through torch.set_num_threads and the
main thread's affinity), prefix caching off, and a budget that prefills the whole batch in
one step. Between its runs the peer's processes are stopped (SIGSTOP), so vLLM's idle
worker, which polls for work, takes no CPU from ours; they run in our session, so the
scheduler's per-session shares (autogroup) fall on both sides alike. Greedy token ids of the first
repetition are compared."""

from __future__ import annotations

import json
import os
import queue
import signal
import statistics
import subprocess
import tempfile
import threading
from pathlib import Path
from typing import Any

from hybrid_pd.bench.peer_vllm import Timing, agreeing_tokens, rates, timed_steps

LOAD_TIMEOUT_S = 900.0  # vLLM's import and load on a busy machine
RUN_TIMEOUT_S = 1800.0  # one batch's generate
WARMUP = (
    "after loading, each side ran one untimed generate (largest batch, 16-token prompts, "
    "2 tokens), and before each batch size's reps one untimed generate of that batch's "
    "prompts (2 tokens: the timed shapes' one-time costs are paid before timing); reps "
    "alternate ours/vLLM per batch size, the vLLM processes stopped (SIGSTOP) while ours "
    "runs; figures are medians over reps"
)


def checkpoint_config(path: Path) -> dict:
    config = json.loads((path / "config.json").read_text())
    return config.get("text_config") or config


def checkpoint_dtype(path: Path) -> str:
    """The dtype the checkpoint names, else float32 (what our loader would pick)."""
    text = checkpoint_config(path)
    name = text.get("dtype") or text.get("torch_dtype") or "float32"
    return str(name).removeprefix("torch.")


def bench_cpus(threads: int) -> list[int]:
    cpus = sorted(os.sched_getaffinity(0))
    if threads < 1 or threads > len(cpus):
        raise ValueError(f"--threads {threads}: this process may use {len(cpus)} CPUs")
    return cpus[:threads]


class VllmPeer:
    """The child process running `peer_vllm` under vLLM's Python, in its own process
    group. `close()` always ends it (quit, then SIGTERM, then SIGKILL)."""

    def __init__(
        self,
        python: str,
        model: Path,
        dtype: str,
        *,
        max_model_len: int,
        max_batch: int,
        max_batched_tokens: int,
        cpus: list[int],
        env: dict[str, str],
        compiled: bool = False,
    ) -> None:
        from hybrid_pd.workers.vllm_server import TCMALLOC, own_temp_dir

        root = str(Path(__file__).resolve().parents[2])  # run this checkout's module
        full = dict(os.environ)
        full.update(
            VLLM_CPU_NUM_OF_RESERVED_CPU="0",
            VLLM_CPU_OMP_THREADS_BIND=",".join(map(str, cpus)),
            TOKENIZERS_PARALLELISM="false",
        )
        for lib in TCMALLOC:
            if Path(lib).exists():
                full["LD_PRELOAD"] = lib
                break
        # vLLM's CPU build binds OpenMP threads only in its multiprocess executor (the in-process
        # one runs unbound, with stray busy threads), so the engine core keeps its own process.
        full.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
        self.temp_dir = own_temp_dir(full)  # removed by close()
        full.update(env)
        # HYBRID_PD_PEER_CPU_ISA=avx2: vLLM's own kernels held to AVX2 too (peer_site's doc)
        site = str(Path(__file__).with_name("peer_site"))
        site = site if full.get("HYBRID_PD_PEER_CPU_ISA") else None
        full["PYTHONPATH"] = os.pathsep.join(p for p in (site, root, full.get("PYTHONPATH")) if p)
        self.log = tempfile.NamedTemporaryFile(  # closed in close()
            "w+", prefix="hybrid-pd-peer-vllm-", suffix=".log", delete=False
        )
        args = [
            python, "-m", "hybrid_pd.bench.peer_vllm", "--model", str(model),
            "--dtype", dtype, "--max-model-len", str(max_model_len),
            "--max-batch", str(max_batch), "--max-batched-tokens", str(max_batched_tokens),
        ] + (["--compiled"] if compiled else [])  # fmt: skip
        self.proc = subprocess.Popen(
            args,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.log,
            env=full,
            text=True,
            # A process group of its own (stopped, continued and ended as one), in this
            # session: Linux's autogroup scheduler shares the CPU between sessions first, so
            # a peer in a new session got a whole share of its own while ours shared this
            # session's with whatever else it ran (with two busy processes beside the
            # benchmark: our prefill 31 tokens/s against vLLM's 82-105, 157 / 150 unloaded).
            process_group=0,
        )
        self._lines: queue.Queue[str | None] = queue.Queue()
        self._responsive = True
        threading.Thread(target=self._read, daemon=True).start()
        try:
            self.info = self._reply(LOAD_TIMEOUT_S)
        except BaseException:  # a failed or interrupted load must not leave the child behind
            self.close()
            raise

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._lines.put(line)
        self._lines.put(None)

    def _reply(self, timeout: float) -> dict[str, Any]:
        try:
            line = self._lines.get(timeout=timeout)
        except queue.Empty:
            self._responsive = False  # close() goes straight to signals
            msg = f"vLLM peer gave no answer in {timeout:.0f} s{self._tail()}"
            raise TimeoutError(msg) from None
        if line is None:
            self.proc.wait(10)
            raise RuntimeError(f"vLLM peer exited ({self.proc.returncode}){self._tail()}")
        msg = json.loads(line)
        if not msg.get("ok"):
            raise RuntimeError(f"vLLM peer failed:\n{msg.get('error')}{self._tail()}")
        return msg

    def _tail(self, n: int = 30) -> str:
        self.log.flush()
        lines = Path(self.log.name).read_text(errors="replace").splitlines()[-n:]
        return f"\n(log {self.log.name}, last lines:)\n" + "\n".join(lines)

    def run(self, prompts: list[list[int]], max_tokens: int) -> Timing:
        """One timed generate; the peer's processes are stopped again once it answered."""
        assert self.proc.stdin is not None
        self._signal(signal.SIGCONT)
        msg = {"op": "run", "prompts": prompts, "max_tokens": max_tokens}
        self.proc.stdin.write(json.dumps(msg) + "\n")
        self.proc.stdin.flush()
        r = self._reply(RUN_TIMEOUT_S)
        # Idle, vLLM's worker process polls for work on the CPU it is bound to, the one our
        # engine computes on: it took 0.4-0.7 s of CPU during our 1.0-1.4 s batch-1 runs,
        # half our time. Stopped (SIGSTOP to its process group) it takes none until its turn.
        self._signal(signal.SIGSTOP)
        return Timing(r["prefill_s"], r["decode_s"], r["token_ids"])

    def _signal(self, sig: signal.Signals) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                pass

    def close(self) -> None:
        try:
            self._stop()
        finally:  # even when interrupted while stopping
            if self.proc.poll() is None:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
            self.log.close()
            from hybrid_pd.workers.vllm_server import remove_temp_dir

            remove_temp_dir(self.temp_dir)
        # a run that ended well needs no log; a failed one named it in its error
        if self.proc.returncode == 0:
            Path(self.log.name).unlink(missing_ok=True)

    def _stop(self) -> None:
        self._signal(signal.SIGCONT)  # a stopped peer would not read "quit" nor act on SIGTERM
        if self.proc.poll() is None and self._responsive:
            try:
                assert self.proc.stdin is not None
                self.proc.stdin.write(json.dumps({"op": "quit"}) + "\n")
                self.proc.stdin.close()
                self.proc.wait(30)
            except (OSError, ValueError, subprocess.TimeoutExpired):
                pass
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(30)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                pass

    def __enter__(self) -> VllmPeer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class _OurSide:
    def __init__(self, path: Path, dtype: str, held_state_rows_bytes: int | None = None) -> None:
        from hybrid_pd.engine.loader import load_model
        from hybrid_pd.engine.malloc import tune_malloc

        tune_malloc()  # as in every engine process (vLLM's side preloads tcmalloc)

        self.model, self.config, self.tok = load_model(path, dtype=dtype)
        self.dtype = str(next(self.model.parameters()).dtype).removeprefix("torch.")
        self.held_state_rows_bytes = held_state_rows_bytes  # None: the engine's default
        self.held_rows_used: int | None = None  # what the last engine resolved it to

    def run(self, prompts: list[list[int]], max_tokens: int) -> Timing:
        from hybrid_pd.engine.engine import Engine, EngineConfig
        from hybrid_pd.engine.sampling import SamplingParams

        bs, prompt_len = len(prompts), max(len(p) for p in prompts)
        engine = Engine(
            self.model,
            self.config,
            EngineConfig(
                kv_memory_bytes=1 << 30,
                max_num_batched_tokens=prompt_len * bs,
                max_num_seqs=bs,
                enable_prefix_caching=False,
                held_state_rows_bytes=self.held_state_rows_bytes,
            ),
            self.tok,
        )
        self.held_rows_used = engine.pool.held_rows_bytes
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)

        def submit() -> None:
            for i, p in enumerate(prompts):
                engine.add_request(p, params, request_id=str(i))

        def step():
            return [(o.request_id, o.token_ids, o.finished) for o in engine.step()]

        return timed_steps(submit, step, bs)


def _median(xs: list[float]) -> float:
    return round(statistics.median(xs), 1)


def bench_engine_peer(
    model_name: str,
    prompt_len: int,
    decode_tokens: int,
    batch_sizes: list[int],
    *,
    peer_python: str,
    reps: int = 2,
    dtype: str | None = None,
    threads: int = 1,
    peer_env: dict[str, str] | None = None,
    seed: int = 0,
    confine_peer: bool = False,
    held_state_rows_bytes: int | None = None,
    peer_compiled: bool = False,
    decode_by_difference: bool = False,
) -> dict[str, Any]:
    """Our engine against vLLM's (see the module docstring); the child always ends.

    vLLM binds only its model worker's threads to `cpus`. Its front end and engine-core
    processes run wherever the kernel puts them, so on a machine with more CPUs than `cpus`
    its scheduling and output handling overlap the model on another CPU, while ours share
    `cpus` with our model. `confine_peer` starts every vLLM process on `cpus` alone.
    `peer_compiled`: vLLM in its default mode (torch.compile'd) instead of eager.
    `decode_by_difference`: also time each batch to its first token alone (`_bench_batch`)."""
    import torch

    from hybrid_pd.bench.machine import add_machine_ratios, checkpoint_costs, machine_figures
    from hybrid_pd.bench.real_shapes import resolve_bench_model
    from hybrid_pd.engine import cpu_kernels
    from hybrid_pd.engine.heap import frozen_heap
    from hybrid_pd.engine.threads import flush_denormals

    flush_denormals()  # as every engine process does, before torch starts its threads
    if decode_tokens < 2:
        raise ValueError("--decode-tokens must be at least 2 (decode counts tokens after the 1st)")
    if reps < 1 or not batch_sizes or min(batch_sizes) < 1:
        raise ValueError("--reps and every batch size must be at least 1")
    path = resolve_bench_model(model_name)
    dtype = dtype or checkpoint_dtype(path)
    vocab = int(checkpoint_config(path)["vocab_size"])
    cpus = bench_cpus(threads)
    gen = torch.Generator().manual_seed(seed)
    max_bs = max(batch_sizes)
    warm = [torch.randint(0, vocab, (16,), generator=gen).tolist() for _ in range(max_bs)]
    affinity = os.sched_getaffinity(0)
    torch_threads = torch.get_num_threads()
    try:
        if confine_peer:
            os.sched_setaffinity(0, cpus)  # the peer's processes inherit it
        with (
            VllmPeer(
                peer_python,
                path,
                dtype,
                max_model_len=prompt_len + decode_tokens,
                max_batch=max_bs,
                max_batched_tokens=max_bs * prompt_len,
                cpus=cpus,
                env=peer_env or {},
                compiled=peer_compiled,
            ) as peer,
            frozen_heap(),
        ):  # as in every engine process (imports: most of the heap)
            # the peer has started (on this process's CPUs unless confined); from here
            # ours computes on `cpus`
            os.sched_setaffinity(0, cpus)
            torch.set_num_threads(threads)
            ours = _OurSide(path, dtype, held_state_rows_bytes)
            ours.run(warm, 2)
            peer.run(warm, 2)
            # measured while the peer is stopped (after each run), on the benchmark's CPUs
            machine = machine_figures()
            costs = checkpoint_costs(path, ours.dtype)
            rows = []
            for bs in batch_sizes:
                prompts = [
                    torch.randint(0, vocab, (prompt_len,), generator=gen).tolist()
                    for _ in range(bs)
                ]
                # new shapes cost once (oneDNN builds a kernel per shape; buffers grow):
                # after the 16-token warmup a first 256-token batch-1 prefill ran at half
                # speed on both sides, which a median of two reps would keep
                ours.run(prompts, 2)
                peer.run(prompts, 2)
                rows.append(
                    _bench_batch(ours, peer, prompts, decode_tokens, reps, decode_by_difference)
                )
                add_machine_ratios(rows[-1], costs, machine)
    finally:
        os.sched_setaffinity(0, affinity)
        torch.set_num_threads(torch_threads)
    return {
        "model": model_name,
        "peer": "vllm",
        # vLLM's mode: "eager" (enforce_eager) or "compiled" (its default, --peer-compiled)
        "vllm_mode": peer.info.get("mode", "eager"),
        "dtype": {"ours": ours.dtype, "vllm": peer.info["dtype"]},
        "threads": {
            "ours": threads,
            "vllm": len(cpus),
            "cpus": cpus,
            "vllm_omp_threads_bind": peer.info["omp_threads_bind"],
            # where vLLM's other processes (front end, engine core) may run
            "vllm_processes_cpus": peer.info["process_cpus"],
        },
        "versions": {
            "torch": torch.__version__,
            "vllm": peer.info["vllm"],
            "vllm_torch": peer.info["torch"],
            # vLLM's own C++ kernels built for AVX-512 (False: its AVX2 build, as with
            # --peer-env HYBRID_PD_PEER_CPU_ISA=avx2 on an AVX-512 machine)
            "vllm_kernels_avx512": peer.info.get("kernels_avx512"),
        },
        "reps": reps,
        "held_state_rows_bytes": ours.held_rows_used,
        # our C kernels (on, or off and why): Qwen3.5's prompt delta rule runs in one
        "cpu_kernels": cpu_kernels.status(),
        "timing": (
            "prefill: batch submitted to every request's first token; decode: from then to "
            "the last request's end; decode tokens/s counts the tokens after the first"
        ),
        # *_prefill_alone / *_decode_by_difference present (see `_bench_batch`)
        "decode_by_difference": decode_by_difference,
        "warmup": WARMUP,
        # what the figures are compared with: per-token costs of the checkpoint, and the
        # GEMM peak and memcpy bandwidth measured on the benchmark's CPUs before the runs
        "machine": machine,
        "costs": costs,
        "runs": rows,
    }


def _bench_batch(
    ours: _OurSide,
    peer: VllmPeer,
    prompts: list[list[int]],
    decode_tokens: int,
    reps: int,
    by_difference: bool = False,
) -> dict[str, Any]:
    """One batch size's row. Per rep and side: the timed run (`timed_steps`), and with
    `by_difference` a run of the same prompts to their first token only: its wall time is
    the prefill's, and the timed run's wall time less it the decode's (`*_by_difference`).
    That split does not depend on when a side reports first tokens: vLLM's front end learns
    of them from its engine-core process, which by then may have run decode steps."""
    bs, prompt_len = len(prompts), len(prompts[0])
    phases = ("prefill", "decode") + (("prefill_alone", "decode_by_difference") * by_difference)
    figures: dict[str, list[float]] = {
        f"{side}_{phase}": [] for side in ("ours", "vllm") for phase in phases
    }
    walls: dict[str, list[float]] = {"ours": [], "vllm": []}
    first: dict[str, list[list[int]]] = {}
    for _ in range(reps):
        for side, runner in (("ours", ours), ("vllm", peer)):
            t = runner.run(prompts, decode_tokens)
            first.setdefault(side, t.token_ids)
            prefill, decode = rates(bs, prompt_len, decode_tokens, t)
            figures[f"{side}_prefill"].append(round(prefill, 1))
            figures[f"{side}_decode"].append(round(decode, 1))
            walls[side].append(t.prefill_s + t.decode_s)
            if by_difference:
                alone = runner.run(prompts, 1).prefill_s
                decode_s = max(walls[side][-1] - alone, 1e-9)
                figures[f"{side}_prefill_alone"].append(round(bs * prompt_len / alone, 1))
                rate = bs * (decode_tokens - 1) / decode_s
                figures[f"{side}_decode_by_difference"].append(round(rate, 1))
    row: dict[str, Any] = {"batch_size": bs, "prompt_len": prompt_len}
    row["decode_tokens"] = decode_tokens
    for key, xs in figures.items():
        row[f"{key}_tokens_per_s"] = _median(xs)
    for key, xs in figures.items():
        row[f"{key}_tokens_per_s_reps"] = xs
    for phase in phases:
        ratio = row[f"ours_{phase}_tokens_per_s"] / row[f"vllm_{phase}_tokens_per_s"]
        row[f"{phase}_ratio"] = round(ratio, 3)
    # the whole batch, submit to last token: vLLM's over ours (above 1: ours took less)
    for side in ("ours", "vllm"):
        row[f"{side}_wall_s_reps"] = [round(w, 3) for w in walls[side]]
    wall = statistics.median(walls["vllm"]) / statistics.median(walls["ours"])
    row["wall_ratio"] = round(wall, 3)
    a, b = first["ours"], first["vllm"]
    row["greedy_equal_sequences"] = sum(x == y for x, y in zip(a, b, strict=True))
    row["greedy_agreeing_tokens_mean"] = round(
        statistics.mean(agreeing_tokens(x, y) for x, y in zip(a, b, strict=True)), 2
    )
    row["ours_token_ids_rep0"] = a
    row["vllm_token_ids_rep0"] = b
    return row


def summary(result: dict[str, Any]) -> str:
    """A few lines for people (the CLI without --json)."""
    th, dt = result["threads"], result["dtype"]
    lines = [
        f"{result['model']}: ours (torch {result['versions']['torch']}) vs vLLM "
        f"{result['versions']['vllm']}, dtype {dt['ours']}/{dt['vllm']}, {th['ours']} thread(s) "
        f"each on CPUs {th['cpus']}, medians of {result['reps']} alternating reps",
        f"{'batch':>5} {'prefill ours':>13} {'vLLM':>9} {'ratio':>6} "
        f"{'decode ours':>12} {'vLLM':>9} {'ratio':>6}  greedy equal",
    ]
    for r in result["runs"]:
        lines.append(
            f"{r['batch_size']:>5} {r['ours_prefill_tokens_per_s']:>13} "
            f"{r['vllm_prefill_tokens_per_s']:>9} {r['prefill_ratio']:>6} "
            f"{r['ours_decode_tokens_per_s']:>12} {r['vllm_decode_tokens_per_s']:>9} "
            f"{r['decode_ratio']:>6}  {r['greedy_equal_sequences']}/{r['batch_size']}"
        )
    lines.append("tokens/s; ratio = ours / vLLM")
    return "\n".join(lines)


def parse_env(pairs: list[str]) -> dict[str, str]:
    env = {}
    for kv in pairs:
        key, sep, value = kv.partition("=")
        if not sep or not key:
            raise ValueError(f"--peer-env {kv!r}: expected KEY=VALUE")
        env[key] = value
    return env


def peer_python(flag: str | None) -> str:
    python = flag or os.environ.get("HYBRID_PD_VLLM_PYTHON")
    if not python:
        raise SystemExit(
            "--peer vllm needs vLLM's Python: pass --peer-python PATH "
            "(e.g. .venv-vllm/bin/python) or set HYBRID_PD_VLLM_PYTHON"
        )
    if not Path(python).exists():
        raise SystemExit(f"--peer-python {python}: no such file")
    return python
