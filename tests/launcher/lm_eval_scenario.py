"""Run inside a fresh network namespace (only loopback): lm-evaluation-harness's
`local-completions` against `hybrid-pd serve` (P/D) and the same harness against one engine
in-process, on a small loglikelihood task and a small generate-until task made here.
Prints one JSON line: both runs' scores and whether every per-document answer matched."""

from __future__ import annotations

import json
import os
import random
import sys
import tempfile
from pathlib import Path

TASKS = ("hpd_choice", "hpd_until")


def write_tasks(folder: Path, vocab: str) -> None:
    """Two tasks over random text (a random model scores it; both runs must agree)."""
    rng = random.Random(7)

    def words(n: int) -> str:
        return " ".join(
            "".join(rng.choice(vocab) for _ in range(rng.randint(2, 6))) for _ in range(n)
        )

    with open(folder / "choice.jsonl", "w") as f:
        for _ in range(12):
            choices = [words(2) for _ in range(3)]
            f.write(
                json.dumps({"question": words(12), "choices": choices, "label": rng.randrange(3)})
                + "\n"
            )
    with open(folder / "until.jsonl", "w") as f:
        for _ in range(8):
            f.write(json.dumps({"prompt": words(14), "answer": words(1)}) + "\n")
    (folder / "hpd_choice.yaml").write_text(
        f"""task: hpd_choice
dataset_path: json
dataset_kwargs:
  data_files:
    test: {folder / "choice.jsonl"}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{label}}}}"
metric_list:
  - metric: acc
"""
    )
    (folder / "hpd_until.yaml").write_text(
        f"""task: hpd_until
dataset_path: json
dataset_kwargs:
  data_files:
    test: {folder / "until.jsonl"}
test_split: test
output_type: generate_until
doc_to_text: "{{{{prompt}}}}"
doc_to_target: "{{{{answer}}}}"
generation_kwargs:
  until: [" "]
  max_gen_toks: 8
  do_sample: false
  temperature: 0
metric_list:
  - metric: exact_match
"""
    )


def in_process_model(base, engine):
    """lm-eval's own local-completions model, answered by one engine in this process: the
    payloads lm-eval builds are run on `engine` and answered in the OpenAI shape."""
    from hybrid_pd.engine.sampling import SamplingParams

    class InProcess(base):
        def model_call(self, messages, *, generate=True, gen_kwargs=None, **kwargs):
            import copy

            payload = self._create_payload(
                self.create_message(messages),
                generate=generate,
                gen_kwargs=copy.deepcopy(gen_kwargs),
                seed=self._seed,
                eos=self.eos_string,
            )
            prompts = payload["prompt"]
            choices = []
            for i, prompt in enumerate(prompts):
                if generate:
                    stop = payload.get("stop") or ()
                    params = SamplingParams(
                        max_tokens=payload["max_tokens"], stop=tuple(stop), seed=payload["seed"]
                    )
                    out = engine.generate([prompt], params)[0]
                    choices.append({"index": i, "text": out.text})
                    continue
                params = SamplingParams(max_tokens=1, logprobs=1, prompt_logprobs=1)
                out = engine.generate([prompt], params)[0]
                scored = [None, *out.prompt_logprobs[1:], *out.logprobs]
                token_lp = [None if s is None else s.logprob for s in scored]
                top = [None if s is None else {str(t): v for t, v in s.top} for s in scored]
                choices.append(
                    {"index": i, "logprobs": {"token_logprobs": token_lp, "top_logprobs": top}}
                )
            return {"choices": choices}

    return InProcess


def samples_of(results: dict) -> dict:
    out = {}
    for task in TASKS:
        out[task] = [
            s["filtered_resps"] for s in sorted(results["samples"][task], key=lambda s: s["doc_id"])
        ]
    return out


def main() -> int:
    import lm_eval
    from lm_eval.models.openai_completions import LocalCompletionsAPI
    from lm_eval.tasks import TaskManager

    from hybrid_pd.engine.engine import Engine, EngineConfig
    from hybrid_pd.engine.loader import load_model
    from hybrid_pd.engine.threads import set_torch_threads
    from hybrid_pd.engine.tiny import resolve_model
    from hybrid_pd.launcher.serve import Deployment, ServeConfig, wait_ready

    set_torch_threads(1)  # as every engine process: subnormals flushed, then 1 thread
    folder = Path(tempfile.mkdtemp(prefix="hpd-lm-eval-"))
    write_tasks(folder, "abcdefghij")
    path = resolve_model("tiny")
    tasks = TaskManager(include_path=str(folder))
    common = dict(model="tiny", tokenizer_backend="huggingface", tokenizer=str(path), max_retries=1)
    # Prompts of >= 8 tokens go through the prefill pool, then decode: P/D for every request.
    dep = Deployment(
        ServeConfig(port=0, kv_memory="32MiB", threads=1, min_prefill_tokens=8, lease_s=10.0)
    )
    result: dict = {}
    try:
        wait_ready(dep.url)
        served = LocalCompletionsAPI(base_url=dep.url + "/v1/completions", **common)
        pd = lm_eval.simple_evaluate(
            model=served, tasks=list(TASKS), task_manager=tasks, log_samples=True
        )
        import httpx

        metrics = httpx.get(dep.url + "/metrics", timeout=10).text
        result["routes"] = {
            line.split('"')[1]: float(line.split()[-1])
            for line in metrics.splitlines()
            if line.startswith("hybrid_pd_proxy_routes_total{")
        }
    finally:
        dep.close()
    model, config, tok = load_model(path)
    engine = Engine(model, config, EngineConfig(kv_memory_bytes=32 * 2**20), tok)
    local = in_process_model(LocalCompletionsAPI, engine)(base_url="http://unused", **common)
    one = lm_eval.simple_evaluate(
        model=local, tasks=list(TASKS), task_manager=tasks, log_samples=True
    )
    result["pd"] = {t: pd["results"][t] for t in TASKS}
    result["single"] = {t: one["results"][t] for t in TASKS}
    a, b = samples_of(pd), samples_of(one)
    result["documents"] = {t: len(a[t]) for t in TASKS}
    result["generations_equal"] = a["hpd_until"] == b["hpd_until"]
    result["generations_vary"] = len({json.dumps(x) for x in a["hpd_until"]}) > 1
    ll_a = [ll for doc in a["hpd_choice"] for ll, _ in doc]
    ll_b = [ll for doc in b["hpd_choice"] for ll, _ in doc]
    result["loglikelihood_max_diff"] = max(abs(x - y) for x, y in zip(ll_a, ll_b, strict=True))
    result["greedy_flags_equal"] = [g for doc in a["hpd_choice"] for _, g in doc] == [
        g for doc in b["hpd_choice"] for _, g in doc
    ]
    print(json.dumps(result, default=str))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    sys.exit(main())
