"""bfloat16 parity: each family loaded in bf16 through the real loader (oneDNN linears on
CPU, bf16 KV pages, recurrent states in the dtype the config names) is as close to the
float32 reference as transformers' own bf16 run of the same checkpoint.

bf16 cannot be compared token for token (its rounding flips greedy choices within a few
steps on random weights), so the test is teacher-forced: both bf16 runs see the float32
reference's greedy tokens, and their logits at every position are compared with the
reference's. Our error may be at most twice transformers' (ours decodes step by step from
bf16 pages; transformers runs the whole sequence at once)."""

from __future__ import annotations

import copy

import pytest
import torch
import transformers as hft

from hybrid_pd.engine.loader import load_model
from tests.engine import test_gemma3, test_granite_hybrid, test_qwen3_5
from tests.engine.harness import PagedRunner

PROMPT, FORCED = 40, 24


pytestmark = pytest.mark.usefixtures("one_thread")


def _gemma3():
    model = hft.Gemma3ForCausalLM(hft.Gemma3TextConfig(**test_gemma3._text_kwargs())).eval()
    test_gemma3._randomize_norms(model)
    return model, test_gemma3.VOCAB


def _qwen3_5():
    # published checkpoints keep the recurrent state in float32
    config = test_qwen3_5.Qwen3_5TextConfig(**test_qwen3_5.SMALL, mamba_ssm_dtype="float32")
    return test_qwen3_5.HFQwen3_5ForCausalLM(config).eval(), test_qwen3_5.VOCAB


def _granite():
    cfg = hft.GraniteMoeHybridConfig(**test_granite_hybrid.DENSE)
    model = hft.GraniteMoeHybridForCausalLM(cfg).eval()
    with torch.no_grad():  # heads that decay at different rates, as in the fp32 tests
        for layer in model.model.layers:
            if layer.mamba is not None:
                layer.mamba.A_log.uniform_(-1.0, 1.0)
                layer.mamba.dt_bias.uniform_(-2.0, 0.5)
                layer.mamba.D.normal_()
    return model, test_granite_hybrid.VOCAB


@torch.no_grad()
def _forced(runner: PagedRunner, prompt: list[int], forced: list[int]) -> torch.Tensor:
    """Our logits predicting forced[0..] : the prompt in one step, then one forced token a
    step (the step's input is the previous forced token)."""
    tokens = list(prompt)
    rows = [runner.step([("r", tokens, list(prompt))])[0]]
    for t in forced[:-1]:
        tokens.append(t)
        rows.append(runner.step([("r", tokens, [t])])[0])
    runner.mgr.free("r")
    runner.mgr.check_integrity()
    return torch.stack(rows)


@pytest.mark.parametrize(
    "build", [_gemma3, _qwen3_5, _granite], ids=["gemma3", "qwen3_5", "granite"]
)
def test_bf16_as_close_to_fp32_as_transformers_bf16(build, tmp_path):
    torch.manual_seed(0)
    hf, vocab = build()
    hf.generation_config.eos_token_id = None
    hf.save_pretrained(tmp_path, safe_serialization=True)
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(3, vocab, (PROMPT,), generator=g).tolist()
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = hf.generate(ids, max_new_tokens=FORCED, do_sample=False, pad_token_id=0)
        forced = out[0, PROMPT:].tolist()
        assert len(set(forced)) >= 4, "reference output too repetitive to prove anything"
        full = torch.tensor([prompt + forced[:-1]])
        want = hf(input_ids=full).logits[0, PROMPT - 1 :].float()
        theirs = copy.deepcopy(hf).to(torch.bfloat16)(input_ids=full).logits[0, PROMPT - 1 :]
        theirs = theirs.float()

    ours_model, config, _ = load_model(tmp_path, dtype="bfloat16")
    assert next(ours_model.parameters()).dtype is torch.bfloat16
    ours = _forced(PagedRunner(ours_model, config, kv_dtype="bfloat16"), prompt, forced)

    their_err = (theirs - want).abs()
    our_err = (ours - want).abs()
    assert their_err.max() > 0, "transformers' bf16 run equals fp32: nothing is measured"
    assert our_err.mean() <= 2 * their_err.mean(), (our_err.mean(), their_err.mean())
    assert our_err.max() <= 2 * their_err.max(), (our_err.max(), their_err.max())
    # greedy choices under teacher forcing: as many agree with fp32 as transformers' do
    agree_ours = (ours.argmax(-1) == want.argmax(-1)).sum().item()
    agree_theirs = (theirs.argmax(-1) == want.argmax(-1)).sum().item()
    assert agree_ours >= agree_theirs - 2, (agree_ours, agree_theirs, FORCED)
