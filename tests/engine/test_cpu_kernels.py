"""The C kernels (hybrid_pd/engine/cpu_kernels/) against their PyTorch counterparts, their
build (cache, fallback without a compiler) and their use by the models."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from hybrid_pd.engine import cpu_kernels
from hybrid_pd.engine.models.gated_deltanet import _l2norm, delta_rule_chunked, delta_rule_step

pytestmark = pytest.mark.usefixtures("one_thread")


def test_the_kernels_build_here():
    # .ci/run's machine has a C compiler: the fast path must be the one the tests exercise
    assert cpu_kernels.library() is not None, cpu_kernels.status()
    assert cpu_kernels.status() == "on"


def _gdn_inputs(n, hk, hv, dk, dv, channel_major, seed=0):
    gen = torch.Generator().manual_seed(seed)
    width = 2 * hk * dk + hv * dv
    if channel_major:  # as a prompt's q, k and v leave the convolution
        mixed = torch.randn(width, n, generator=gen).t()
    else:
        mixed = torch.randn(n, width, generator=gen)
    q, k, v = torch.split(mixed, [hk * dk, hk * dk, hv * dv], -1)
    q = _l2norm(q.reshape(n, hk, dk) if not channel_major else q.view(n, hk, dk)) * dk**-0.5
    k = _l2norm(k.view(n, hk, dk))
    v = v.view(n, hv, dv)
    # decays from strong (exp(-6)) to none, so subnormal-prone products appear too
    g = -torch.rand(n, hv, generator=gen) * 6
    beta = torch.rand(n, hv, generator=gen)
    state = torch.randn(hv, dk, dv, generator=gen) * 0.5
    return q, k, v, g, beta, state


def _token_by_token(q, k, v, g, beta, state):
    rep = v.shape[1] // q.shape[1]
    qq, kk = q.repeat_interleave(rep, 1), k.repeat_interleave(rep, 1)
    outs = []
    for t in range(q.shape[0]):
        o, state = delta_rule_step(qq[t], kk[t], v[t], g[t], beta[t], state)
        outs.append(o)
    return torch.stack(outs), state


@pytest.mark.parametrize(
    ("n", "hk", "hv", "dk", "dv", "channel_major"),
    [
        (256, 4, 8, 64, 64, True),  # the specialised head size, layout of a prompt
        (37, 2, 4, 128, 128, False),  # the other specialised size
        (50, 2, 6, 16, 24, True),  # any other size: the general loop
        (2, 1, 1, 8, 8, False),
    ],
)
def test_gdn_recurrent_equals_the_token_by_token_rule(n, hk, hv, dk, dv, channel_major):
    q, k, v, g, beta, state = _gdn_inputs(n, hk, hv, dk, dv, channel_major)
    want_o, want_state = _token_by_token(q, k, v, g, beta, state.clone())
    own = state.clone()
    o = cpu_kernels.gdn_recurrent(q, k, v, g, beta, own)
    assert o is not None
    assert o.shape == (n, hv, dv)
    scale = want_o.abs().max().item()
    assert (o - want_o).abs().max().item() <= 1e-5 * max(1.0, scale)
    assert (own - want_state).abs().max().item() <= 1e-5 * max(1.0, want_state.abs().max().item())
    # and within float rounding of the chunked PyTorch form the model used before
    rep = hv // hk
    chunk_o, _ = delta_rule_chunked(
        q.repeat_interleave(rep, 1).transpose(0, 1),
        k.repeat_interleave(rep, 1).transpose(0, 1),
        v.transpose(0, 1),
        g.t(),
        beta.t(),
        state.clone(),
    )
    assert (o - chunk_o.transpose(0, 1)).abs().max().item() <= 1e-4 * max(1.0, scale)


def test_gdn_recurrent_split_over_threads_is_bit_for_bit():
    q, k, v, g, beta, state = _gdn_inputs(256, 4, 8, 64, 64, True, seed=3)
    one = state.clone()
    o1 = cpu_kernels.gdn_recurrent(q, k, v, g, beta, one)
    torch.set_num_threads(2)
    try:
        two = state.clone()
        o2 = cpu_kernels.gdn_recurrent(q, k, v, g, beta, two)
    finally:
        torch.set_num_threads(1)
    assert torch.equal(o1, o2)
    assert torch.equal(one, two)


def _row_kernel_calls(dtype):
    """Calls of the kernels that split rows or sequences over threads, each big enough to
    split, with fresh inputs (states are updated in place) per call."""
    gen = torch.Generator().manual_seed(11)

    def r(*shape):
        return torch.randn(*shape, generator=gen).to(dtype)

    gate, up, x3, z3, w64 = r(300, 512), r(300, 512), r(300, 8, 64), r(300, 8, 64), r(64)
    y, z2, x2, w512 = r(300, 512).float(), r(300, 512), r(300, 512), r(512)
    calls = {
        "act_mul": lambda: cpu_kernels.act_mul("gelu_tanh", gate, up),
        "norm_gate": lambda: cpu_kernels.norm_gate(x3, z3, w64, 1e-6),
        "gate_norm": lambda: cpu_kernels.gate_norm(y, z2, w512, 256, 1e-6),
    }
    if dtype is torch.float32:
        calls["rms_norm"] = lambda: cpu_kernels.rms_norm(x2, w512, 1e-6, 1.0)
        cos, sin = r(300, 1, 64), r(300, 1, 64)
        calls["norm_rope"] = lambda: cpu_kernels.norm_rope(x3, cos, sin, w64, 1e-6, 1.0)
        windows, taps, first = r(310, 512), r(4, 512), torch.arange(300) + 3
        calls["conv_silu"] = lambda: cpu_kernels.conv_silu(windows, taps, w512, first)
        conv_states, taps_last = r(300, 512, 3), taps.t().contiguous()

        def conv_step():
            st = conv_states.clone()
            return cpu_kernels.conv_step_silu(st, x2, taps_last, w512), st

        calls["conv_step_silu"] = conv_step
        q, k, v, g, beta, state = _gdn_inputs(32, 4, 8, 64, 64, False, seed=4)
        states = torch.stack([state * (1 + i / 32) for i in range(32)])

        def gdn():
            st = states.clone()
            return cpu_kernels.gdn_step(q, k, v, g, beta, st), st

        calls["gdn_step"] = gdn
        sx, sb, sc, sdt, sa, sgen = _ssd_inputs(32, 16, 64, 64, 1, 3)
        ssd_state = torch.randn(32, 16, 64, 64, generator=sgen)

        def ssd():
            st = ssd_state.clone()
            return cpu_kernels.ssd_step(sx, sdt, sa, sb, sc, st), st

        calls["ssd_step"] = ssd
    return calls


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_row_kernels_split_over_threads_bit_for_bit(dtype):
    """The element-wise kernels split by rows and the decode state steps by sequences over
    torch's threads: each output is one thread's, the same bits as on one thread."""
    calls = _row_kernel_calls(dtype)
    one = {name: call() for name, call in calls.items()}
    torch.set_num_threads(2)
    try:
        assert cpu_kernels.kernel_threads() == 2
        two = {name: call() for name, call in calls.items()}
    finally:
        torch.set_num_threads(1)
    for name in calls:
        a, b = one[name], two[name]
        a, b = (a, b) if isinstance(a, tuple) else ((a,), (b,))
        for x, y in zip(a, b, strict=True):
            assert x is not None and torch.equal(x, y), name


def test_ssd_step_declines_what_it_does_not_take():
    x, dt, a = torch.randn(2, 4, 8), torch.rand(2, 4), -torch.rand(4)
    b, c, state = torch.randn(2, 1, 16), torch.randn(2, 1, 16), torch.randn(2, 4, 8, 16)
    assert cpu_kernels.ssd_step(x, dt, a, b, c, state.double()) is None
    assert cpu_kernels.ssd_step(x, dt, a, b, c, state.transpose(-1, -2)) is None
    assert cpu_kernels.ssd_step(x, dt, a, b, c[:, :, :8], state) is None
    assert cpu_kernels.ssd_step(x, dt, a[:3], b, c, state) is None


def test_gdn_recurrent_declines_what_it_does_not_take():
    q, k, v, g, beta, state = _gdn_inputs(8, 2, 4, 16, 16, False)
    assert cpu_kernels.gdn_recurrent(q.double(), k, v, g, beta, state) is None
    assert cpu_kernels.gdn_recurrent(q, k, v, g, beta, state.transpose(1, 2)) is None
    assert cpu_kernels.gdn_recurrent(q, k, v, g, beta, state[:3]) is None
    assert cpu_kernels.gdn_recurrent(q, k, v, g[:, :3], beta[:, :3], state) is None


def _probe(env: dict, code: str) -> str:
    done = subprocess.run(
        [sys.executable, "-c", code],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


_STATUS = "from hybrid_pd.engine import cpu_kernels; print(cpu_kernels.status())"


def test_a_machine_without_a_compiler_takes_the_pytorch_path(tmp_path):
    out = _probe(
        {"HYBRID_PD_KERNEL_CACHE": str(tmp_path), "CC": "no-such-compiler", "PATH": "/nonexistent"},
        _STATUS,
    )
    assert out.startswith("off (no C compiler"), out
    assert not list(tmp_path.iterdir())


def test_the_switch_turns_the_kernels_off(tmp_path):
    out = _probe({"HYBRID_PD_KERNEL_CACHE": str(tmp_path), "HYBRID_PD_CPU_KERNELS": "0"}, _STATUS)
    assert out == "off (HYBRID_PD_CPU_KERNELS=0)"


def test_a_build_is_cached_and_reused(tmp_path):
    env = {"HYBRID_PD_KERNEL_CACHE": str(tmp_path)}
    code = "from hybrid_pd.engine import cpu_kernels; print(cpu_kernels._build())"
    first = _probe(env, code)
    built = list(tmp_path.iterdir())
    assert [p.name for p in built] == [os.path.basename(first)]
    mtime = built[0].stat().st_mtime_ns
    assert _probe(env, code) == first
    assert built[0].stat().st_mtime_ns == mtime  # not rebuilt


def test_qwen3_5_prefill_runs_the_kernel_and_matches_the_pytorch_path(monkeypatch):
    from hybrid_pd.engine.models.gated_deltanet import GatedDeltaNet

    cfg = dict(
        hidden_size=128,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=64,
        linear_value_head_dim=64,
        linear_conv_kernel_dim=4,
        hidden_act="silu",
        rms_norm_eps=1e-6,
    )
    torch.manual_seed(0)
    layer = GatedDeltaNet(cfg, "layers.0.linear_attn")
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0, 0.3)
    n = 70
    x = torch.randn(n, cfg["hidden_size"])
    conv_dim = layer.conv_dim
    qkv, _, b, a = layer._project(x)
    mixed, _ = layer._conv(qkv, torch.zeros(conv_dim, layer.kernel - 1))
    beta = b.sigmoid().float()
    g = -layer.A_log.float().exp() * torch.nn.functional.softplus(a.float() + layer.dt_bias)
    state = torch.randn(4, 64, 64) * 0.1
    before = state.clone()
    calls = []
    real = cpu_kernels.gdn_recurrent

    def counting(*args):
        out = real(*args)
        calls.append(out is not None)
        return out

    with torch.no_grad():
        monkeypatch.setattr(cpu_kernels, "gdn_recurrent", counting)
        o_kernel, s_kernel = layer._delta(mixed, g, beta, state)
        monkeypatch.setattr(cpu_kernels, "gdn_recurrent", lambda *args: None)
        o_torch, s_torch = layer._delta(mixed, g, beta, state)
    assert calls == [True]
    assert not torch.equal(o_kernel, o_torch)  # two different computations ...
    assert torch.allclose(o_kernel, o_torch, atol=1e-5, rtol=1e-4)  # ... of the same values
    assert torch.allclose(s_kernel, s_torch, atol=1e-5, rtol=1e-4)
    assert torch.equal(state, before)  # the pool's state is not written in place


def _ssd_inputs(rows, heads, hd, ns, groups, seed, offset=0):
    """x, b, c as views of one activation row (as the conv leaves them; `offset` columns
    before them), dt and a_coef."""
    gen = torch.Generator().manual_seed(seed)
    width = heads * hd + 2 * groups * ns
    act = torch.randn(rows, offset + width, generator=gen)[:, offset:]
    x = act[:, : heads * hd].view(rows, heads, hd)
    b = act[:, heads * hd : heads * hd + groups * ns].view(rows, groups, ns)
    c = act[:, heads * hd + groups * ns :].view(rows, groups, ns)
    dt = torch.rand(rows, heads, generator=gen) * 0.5
    a_coef = -torch.rand(heads, generator=gen) * 4
    return x, b, c, dt, a_coef, gen


@pytest.mark.parametrize(
    ("seqs", "heads", "hd", "ns", "groups"),
    [
        (32, 16, 64, 64, 1),  # Granite-4.0-H-like, a batch-32 decode step
        (3, 8, 16, 128, 2),  # two groups, the other specialised state size
        (5, 6, 8, 24, 3),  # a state size that leaves a remainder after the vector lanes
        (1, 2, 4, 8, 1),
    ],
)
def test_ssd_step_equals_the_pytorch_step(seqs, heads, hd, ns, groups):
    from hybrid_pd.engine.models.mamba2 import _ssd_step

    x, b, c, dt, a_coef, gen = _ssd_inputs(seqs, heads, hd, ns, groups, seqs, offset=5)
    # states as gathered rows of a pool: each row strided past the next
    pool = torch.randn(seqs, 2, heads, hd, ns, generator=gen)
    state = pool[:, 1]
    untouched = pool[:, 0].clone()
    assert seqs == 1 or not state.is_contiguous()
    want_y, want_state = _ssd_step(x, dt, a_coef, b, c, state.clone(), in_place=True)
    y = cpu_kernels.ssd_step(x, dt, a_coef, b, c, state)
    assert y is not None
    assert (y - want_y).abs().max().item() <= 1e-5 * max(1.0, want_y.abs().max().item())
    assert (state - want_state).abs().max().item() <= 1e-6 * max(1.0, state.abs().max().item())
    assert torch.equal(pool[:, 0], untouched)  # the rows between are not written


@pytest.mark.parametrize("hd", [16, 20, 48])
def test_ssd_step_sums_a_row_alike_whatever_rows_are_beside_it(hd):
    """Rows of a head go sixteen at a time where the kernel has a vector form for that
    (AVX-512), one at a time otherwise (here: each row alone, hd 1, and a head's last
    rows past a multiple of 16): both add a row's lane sums in one tree, so each row's
    output and state are the same bits either way."""
    seqs, heads, ns = 4, 2, 64
    x, b, c, dt, a_coef, gen = _ssd_inputs(seqs, heads, hd, ns, 1, 3)
    state = torch.randn(seqs, heads, hd, ns, generator=gen)
    rows_state = state.clone()
    y = cpu_kernels.ssd_step(x, dt, a_coef, b, c, state)
    assert y is not None
    for p in range(hd):
        one = rows_state[:, :, p : p + 1].contiguous()
        y1 = cpu_kernels.ssd_step(x[:, :, p : p + 1], dt, a_coef, b, c, one)
        assert y1 is not None
        assert torch.equal(y1[:, :, 0], y[:, :, p]), p
        assert torch.equal(one[:, :, 0], state[:, :, p]), p


@pytest.mark.parametrize(
    ("lengths", "heads", "hd", "ns", "groups"),
    [
        ([256, 256], 16, 64, 64, 1),  # Granite-4.0-H-like prompts
        ([5, 70, 1, 33], 8, 16, 128, 2),  # uneven prompts, two groups
        ([40], 6, 8, 24, 3),  # a state size that leaves a remainder after the vector lanes
    ],
)
def test_ssd_scan_equals_the_chunked_scan(lengths, heads, hd, ns, groups):
    from hybrid_pd.engine.models.mamba2 import _ssd_packed

    total, seqs = sum(lengths), len(lengths)
    x, b, c, dt, a_coef, gen = _ssd_inputs(total, heads, hd, ns, groups, len(lengths))
    h0 = torch.randn(seqs, heads, hd, ns, generator=gen) * 0.5
    want_y, want_h1 = _ssd_packed(x, dt, a_coef, b, c, 64, h0.clone(), [0] * seqs, lengths)
    h1 = h0.clone()
    y = cpu_kernels.ssd_scan(x, dt, a_coef, b, c, h1, lengths)
    assert y is not None
    assert (y - want_y).abs().max().item() <= 2e-5 * max(1.0, want_y.abs().max().item())
    assert (h1 - want_h1).abs().max().item() <= 2e-5 * max(1.0, want_h1.abs().max().item())
    # split over two threads (by heads): the same sums, bit for bit
    torch.set_num_threads(2)
    try:
        h2 = h0.clone()
        y2 = cpu_kernels.ssd_scan(x, dt, a_coef, b, c, h2, lengths)
    finally:
        torch.set_num_threads(1)
    assert torch.equal(y, y2)
    assert torch.equal(h1, h2)


def test_a_prompt_and_decode_steps_update_a_gdn_state_bit_for_bit_alike():
    # A token's update is the same whether it comes in a prompt, in a decode step of a
    # batch or alone: where a request's tokens fall (chunks, P/D, batches) changes no bit.
    q, k, v, g, beta, state = _gdn_inputs(24, 2, 4, 64, 64, False, seed=5)
    whole = state.clone()
    o_whole = cpu_kernels.gdn_recurrent(q, k, v, g, beta, whole)
    stepped = state.clone()[None]
    for t in range(q.shape[0]):
        o = cpu_kernels.gdn_step(q[t : t + 1], k[t : t + 1], v[t : t + 1], g[t : t + 1],
                                 beta[t : t + 1], stepped)  # fmt: skip
        assert torch.equal(o[0], o_whole[t])
    assert torch.equal(stepped[0], whole)
    # several sequences in one step, their states apart as gathered rows lie
    rows = torch.stack([state, state * 0.5, state * 2]).clone()
    pool = torch.zeros(3, 2, *state.shape)
    pool[:, 1] = rows
    gathered = pool[:, 1]
    n = 3
    o = cpu_kernels.gdn_step(q[:n], k[:n], v[:n], g[:n], beta[:n], gathered)
    for s in range(n):
        alone = rows[s].clone()[None]
        o_alone = cpu_kernels.gdn_step(
            q[s : s + 1], k[s : s + 1], v[s : s + 1], g[s : s + 1], beta[s : s + 1], alone
        )
        assert torch.equal(o[s], o_alone[0])
        assert torch.equal(gathered[s], alone[0])
    assert not pool[:, 0].any()


def test_a_prompt_and_decode_steps_update_a_mamba2_state_bit_for_bit_alike():
    total, heads, hd, ns, groups = 20, 4, 16, 64, 2
    x, b, c, dt, a_coef, gen = _ssd_inputs(total, heads, hd, ns, groups, 9)
    h0 = torch.randn(1, heads, hd, ns, generator=gen)
    whole = h0.clone()
    y_whole = cpu_kernels.ssd_scan(x, dt, a_coef, b, c, whole, [total])
    stepped = h0.clone()
    for t in range(total):
        sl = slice(t, t + 1)
        y = cpu_kernels.ssd_step(x[sl], dt[sl], a_coef, b[sl], c[sl], stepped)
        assert torch.equal(y[0], y_whole[t])
    assert torch.equal(stepped, whole)


@pytest.mark.parametrize("act", ["silu", "gelu_tanh"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_act_mul_against_float64(act, dtype):
    import torch.nn.functional as F

    def reference(x):
        return F.silu(x) if act == "silu" else F.gelu(x, approximate="tanh")

    gen = torch.Generator().manual_seed(11)
    # the halves of one projection (rows strided), values far into both tails and near 0
    h = (torch.randn(37, 2 * 300, generator=gen) * 8).to(dtype)
    h[0, :6] = torch.tensor([-200.0, 200.0, 0.0, -0.0, 1e-3, -1e-3])
    gate, up = h.split([300, 300], -1)
    out = cpu_kernels.act_mul(act, gate, up)
    assert out is not None and out.dtype is dtype and out.shape == (37, 300)
    x = gate.double()
    if act == "silu":
        exact = F.silu(x) * up.double()
    else:  # 0.5 x (1 + tanh(u)) as x sigmoid(2u): float64's tanh rounds to -1 below u = -19
        exact = x * torch.sigmoid(2 * 0.7978845608028654 * (x + 0.044715 * x**3)) * up.double()
    rel = ((out.double() - exact).abs() / exact.abs().clamp_min(1e-30)).max().item()
    # float32: within a few ulp (GELU: far in the negative tail u's rounding, amplified by
    # exp, leaves 1e-5; PyTorch gives 0 there); bfloat16: one rounding (PyTorch's two: 2^-8)
    bound = (2e-6 if act == "silu" else 2e-5) if dtype is torch.float32 else 2.0**-8
    assert rel <= bound
    torch_rel = ((reference(gate) * up).double() - exact).abs() / exact.abs().clamp_min(1e-30)
    assert rel <= max(torch_rel.max().item(), bound)
    assert not out.isnan().any()


def test_act_mul_declines_what_it_does_not_take():
    g = torch.randn(4, 8)
    assert cpu_kernels.act_mul("relu", g, g) is None
    assert cpu_kernels.act_mul("silu", g.double(), g.double()) is None
    assert cpu_kernels.act_mul("silu", g, g.bfloat16()) is None
    assert cpu_kernels.act_mul("silu", g.t(), g.t()) is None  # columns not contiguous
    assert cpu_kernels.act_mul("silu", g[None], g[None]) is None


@pytest.mark.parametrize("act", ["silu", "gelu_pytorch_tanh"])
def test_gated_mlps_take_the_fused_activation(act, monkeypatch):
    from hybrid_pd.engine.models.common import GatedMLP

    torch.manual_seed(0)
    mlp = GatedMLP(32, 64, act)
    x = torch.randn(5, 32)
    calls = []
    real = cpu_kernels.act_mul

    def counting(act, gate, up):
        out = real(act, gate, up)
        calls.append(out is not None)
        return out

    with torch.no_grad():
        monkeypatch.setattr(cpu_kernels, "act_mul", counting)
        fused = mlp(x)
        monkeypatch.setattr(cpu_kernels, "act_mul", lambda *a: None)
        plain = mlp(x)
    assert calls == [True]
    assert torch.allclose(fused, plain, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_norm_gate_equals_the_pytorch_norm(dtype, monkeypatch):
    from hybrid_pd.engine.models.gated_deltanet import GatedRMSNorm

    gen = torch.Generator().manual_seed(4)
    norm = GatedRMSNorm(64, 1e-6).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.3 * torch.randn(64, generator=gen))
    x = torch.randn(50, 4, 64, generator=gen).to(dtype)
    proj = torch.randn(50, 4 * 64 + 7, generator=gen).to(dtype)  # z: a view of a projection
    z = proj[:, 7:].view(50, 4, 64)
    with torch.no_grad():
        fused = cpu_kernels.norm_gate(x, z, norm.weight, norm.eps)
        monkeypatch.setattr(cpu_kernels, "norm_gate", lambda *a: None)
        plain = norm(x, z)
    assert fused is not None and fused.dtype is dtype and fused.shape == x.shape
    diff = (fused.float() - plain.float()).abs()
    if dtype is torch.float32:
        assert diff.max().item() <= 1e-5
    else:  # the same roundings: equal but where a sum of squares lands on a tie
        scale = plain.float().abs().clamp_min(1e-3)
        assert (diff / scale).max().item() <= 2.0**-7
        assert (diff > 0).float().mean().item() < 0.01


@pytest.mark.parametrize(
    ("dtype", "inner", "group"),
    # 1,536: Granite-4.0-H-350M's one group, wider than the kernels' stack buffers
    [
        (torch.float32, 256, 64),
        (torch.bfloat16, 96, 96),
        (torch.float32, 40, 20),
        (torch.float32, 1536, 1536),
        (torch.bfloat16, 3072, 1536),
    ],
)
def test_gate_norm_equals_mamba2s_pytorch_norm(dtype, inner, group, monkeypatch):
    from hybrid_pd.engine.models.mamba2 import GatedRMSNorm

    gen = torch.Generator().manual_seed(6)
    norm = GatedRMSNorm(inner, group, 1e-5).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.3 * torch.randn(inner, generator=gen))
    y = torch.randn(9, inner, generator=gen)  # Mamba2's y is float32 in every dtype
    proj = torch.randn(9, 2 * inner + 3, generator=gen).to(dtype)
    z = proj[:, 3 : 3 + inner]  # a view of the in_proj output
    with torch.no_grad():
        fused = cpu_kernels.gate_norm(y, z, norm.weight, group, norm.eps)
        monkeypatch.setattr(cpu_kernels, "gate_norm", lambda *a: None)
        plain = norm(y, z)
    assert fused is not None and fused.dtype is torch.float32 and plain.dtype is torch.float32
    assert (fused - plain).abs().max().item() <= 1e-5 * max(1.0, plain.abs().max().item())
    assert cpu_kernels.gate_norm(y.double(), z, norm.weight, group, norm.eps) is None


@pytest.mark.parametrize("offset", [0.0, 1.0])
def test_rms_norm_equals_pytorchs(offset):
    import torch.nn.functional as F

    gen = torch.Generator().manual_seed(8)
    weight = 0.5 + 0.3 * torch.randn(64, generator=gen)
    wide = torch.randn(7, 100, generator=gen)
    for x in (wide[:, 10:74], torch.randn(3, 4, 64, generator=gen), torch.randn(64)):
        got = cpu_kernels.rms_norm(x, weight, 1e-6, offset)
        want = F.rms_norm(x, (64,), weight + offset, 1e-6)
        assert got is not None and got.shape == x.shape
        assert (got - want).abs().max().item() <= 1e-5 * max(1.0, want.abs().max().item())
    assert cpu_kernels.rms_norm(wide[:, 10:74].bfloat16(), weight, 1e-6) is None  # mixed
    assert cpu_kernels.rms_norm(wide[:, 10:74].double(), weight.double(), 1e-6) is None
    assert cpu_kernels.rms_norm(torch.randn(4, 64, 3).transpose(1, 2), weight, 1e-6) is None


def test_l2_norm_equals_the_delta_rules_pytorch_norm():
    from hybrid_pd.engine.models.gated_deltanet import _l2norm

    gen = torch.Generator().manual_seed(10)
    mixed = torch.randn(37, 3 * 4 * 64 + 5, generator=gen)  # q as a view of the conv output
    q = mixed[:, 5 : 5 + 4 * 64]
    for scale in (1.0, 64**-0.5):
        got = cpu_kernels.l2_norm(q, 4, scale, 1e-6)
        want = _l2norm(q.reshape(37, 4, 64)) * scale
        assert got is not None and got.shape == (37, 4, 64)
        torch.testing.assert_close(got, want, rtol=2e-6, atol=1e-7)
    tiny = torch.zeros(2, 8)  # all zeros: eps keeps it finite
    assert torch.equal(cpu_kernels.l2_norm(tiny, 2, 1.0, 1e-6), tiny.view(2, 2, 4))
    assert cpu_kernels.l2_norm(q.bfloat16(), 4, 1.0, 1e-6) is None
    assert cpu_kernels.l2_norm(q, 3, 1.0, 1e-6) is None  # 256 channels are not 3 heads
    assert cpu_kernels.l2_norm(q.t(), 4, 1.0, 1e-6) is None


@pytest.mark.parametrize("offset", [0.0, 1.0])
@pytest.mark.parametrize("after_cast", [False, True])
def test_rms_norm_in_bfloat16_rounds_where_the_pytorch_norm_does(offset, after_cast, monkeypatch):
    from hybrid_pd.engine.models.common import RMSNorm

    gen = torch.Generator().manual_seed(9)
    norm = RMSNorm(512, 1e-6, offset=offset, scale_after_cast=after_cast).bfloat16()
    with torch.no_grad():
        norm.weight.copy_(0.5 + 0.3 * torch.randn(512, generator=gen))
    wide = torch.randn(300, 530, generator=gen).bfloat16()
    for x in (wide[:, 7:519], torch.randn(2, 5, 512, generator=gen).bfloat16()):
        with torch.no_grad():
            fused = norm(x)
            with monkeypatch.context() as m:
                m.setattr(cpu_kernels, "rms_norm", lambda *a: None)
                plain = norm(x)
        assert fused.dtype is torch.bfloat16 and fused.shape == x.shape
        # the same roundings: equal but where the sum of squares, summed in another order,
        # moves a value across a rounding boundary (by a bfloat16 step, at each of the
        # two roundings with `after_cast`)
        diff = (fused.float() - plain.float()).abs()
        assert (diff / plain.float().abs().clamp_min(1e-3)).max().item() <= 2.0**-6
        assert (diff > 0).float().mean().item() < 0.01


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n, k", [(96, 64), (263, 517), (4, 3)])  # tails in rows and columns
@pytest.mark.parametrize("bias", [False, True])
def test_gemv_against_float64(dtype, n, k, bias):
    gen = torch.Generator().manual_seed(n + k)
    w = torch.randn(n, k, generator=gen).to(dtype)
    x = torch.randn(1, k, generator=gen).to(dtype)
    b = torch.randn(n, generator=gen).to(dtype) if bias else None
    got = cpu_kernels.gemv(x, w, b)
    assert got is not None and got.dtype is dtype and got.shape == (1, n)
    exact = x.double() @ w.double().t() + (b.double() if bias else 0)
    scale = (x.double().abs() @ w.double().abs().t()).max().item() + 1
    err = (got.double() - exact).abs().max().item() / scale
    # float32 sums: a few ulp of the sum of magnitudes; bfloat16: its one rounding at the end
    assert err <= (1e-6 if dtype is torch.float32 else 2.0**-8)
    assert torch.equal(cpu_kernels.gemv(x[0], w, b), got[0])  # one row as a vector


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gemv_split_over_threads_is_bit_for_bit(dtype):
    gen = torch.Generator().manual_seed(9)
    w, x, b = torch.randn(2051, 256, generator=gen), torch.randn(1, 256), torch.randn(2051)
    w, x, b = w.to(dtype), x.to(dtype), b.to(dtype)
    one = cpu_kernels.gemv(x, w, b)
    torch.set_num_threads(2)
    try:
        two = cpu_kernels.gemv(x, w, b)
    finally:
        torch.set_num_threads(1)
    assert torch.equal(one, two)


def test_gemv_declines_what_it_does_not_take():
    w, x = torch.randn(8, 16), torch.randn(1, 16)
    assert cpu_kernels.gemv(torch.randn(2, 16), w, None) is None  # more than one row
    assert cpu_kernels.gemv(x, w.t().contiguous().t(), None) is None  # weight not contiguous
    assert cpu_kernels.gemv(x.bfloat16(), w, None) is None
    assert cpu_kernels.gemv(x.double(), w.double(), None) is None
    assert cpu_kernels.gemv(x, w, torch.randn(8).bfloat16()) is None
    assert cpu_kernels.gemv(x, w, torch.randn(9)) is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_linears_take_the_c_kernels(dtype, monkeypatch):
    """Every packed CPU linear of the engine (OneDnnLinear, packed_linear, FusedLinears)
    runs float32 through `panel_linear` at every row count; one row of anything else
    (bfloat16, or `linear` on a weight never packed) through `gemv`, more rows through
    oneDNN (bfloat16 without oneDNN's bfloat16 kernels: the bfloat16 panels). Equal to
    F.linear to rounding either way."""
    import torch.nn.functional as F
    from torch import nn

    from hybrid_pd.engine import onednn

    torch.manual_seed(0)
    layers = [nn.Linear(32, n).to(dtype) for n in (48, 16)]
    for m in layers:
        onednn.use_onednn_linears(m)
    fused = onednn.FusedLinears(*layers)
    calls: dict[str, list[int]] = {"gemv": [], "panel_linear": []}
    for name in calls:
        real = getattr(cpu_kernels, name)

        def counting(x, *args, _real=real, _name=name):
            calls[_name].append(x.shape[0])
            return _real(x, *args)

        monkeypatch.setattr(cpu_kernels, name, counting)
    tol = 1e-5 if dtype is torch.float32 else 2e-2
    for rows in (1, 3):
        for c in calls.values():
            c.clear()
        x = torch.randn(rows, 32).to(dtype)
        w, b = layers[0].weight, layers[0].bias
        with torch.no_grad():
            outs = [
                layers[0](x),
                onednn.linear(x, w, b),
                onednn.packed_linear(x, w, onednn.pack_weight(w)) + b,
                fused(x)[0],
            ]
            want = F.linear(x.float(), w.float(), b.float())
        for out in outs:
            assert out.dtype is dtype
            torch.testing.assert_close(out.float(), want, rtol=tol, atol=tol)
        if dtype is torch.float32:  # everything packed takes the panels; linear() gemv
            assert calls == {"gemv": [1] if rows == 1 else [], "panel_linear": [rows] * 3}
        elif rows == 1:
            assert calls == {"gemv": [1] * 5, "panel_linear": []}
        else:  # without oneDNN's bfloat16 kernels the packed ones take the bfloat16 panels
            panels = [] if onednn.onednn_dtype(dtype) else [rows] * 3
            assert calls == {"gemv": [], "panel_linear": panels}


def _linears_at(threads: int, rows_list, monkeypatch):
    """Outputs of a packed linear, a fused pair and `packed_linear` for each row count,
    with `threads` torch threads, and the row counts the panel kernel saw."""
    from torch import nn

    from hybrid_pd.engine import onednn

    torch.manual_seed(1)
    layers = [nn.Linear(32, n) for n in (48, 16)]
    for m in layers:
        onednn.use_onednn_linears(m)
    fused = onednn.FusedLinears(*layers)
    calls = []
    real = cpu_kernels.panel_linear
    monkeypatch.setattr(
        cpu_kernels, "panel_linear", lambda x, *a: calls.append(x.shape[0]) or real(x, *a)
    )
    torch.set_num_threads(threads)
    try:
        w = layers[0].weight
        packed = onednn.pack_weight(w)
        outs = []
        for rows in rows_list:
            x = torch.randn(rows, 32, generator=torch.Generator().manual_seed(rows))
            with torch.no_grad():
                outs.append([layers[1](x), fused(x)[1], onednn.packed_linear(x, w, packed)])
    finally:
        torch.set_num_threads(1)
        monkeypatch.setattr(cpu_kernels, "panel_linear", real)
    return outs, calls, packed, layers


def test_several_threads_split_the_panels_bit_for_bit(monkeypatch):
    """With several torch threads float32 still goes through the panels, split over torch's
    OpenMP threads, and every output equals the one-thread output bit for bit (each is one
    sum in order, on one thread)."""
    from hybrid_pd.engine import onednn

    assert cpu_kernels.torch_openmp()  # torch's CPU build for Linux: the path under test
    rows_list = (1, 8, 100, 600)
    one, _, _, _ = _linears_at(1, rows_list, monkeypatch)
    two, calls, packed, _ = _linears_at(2, rows_list, monkeypatch)
    assert isinstance(packed, onednn.Panels)
    assert sorted(set(calls)) == list(rows_list)
    for a, b in zip(one, two, strict=True):
        for x, y in zip(a, b, strict=True):
            assert torch.equal(x, y)


def test_several_threads_without_a_shared_runtime_keep_onednn(monkeypatch):
    """Where the kernels could not share torch's OpenMP threads (`kernel_threads` is then
    1), a process with several threads packs float32 for oneDNN, whose GEMM splits over
    torch's threads: no panel calls, the same values as F.linear."""
    import torch.nn.functional as F

    from hybrid_pd.engine import onednn

    monkeypatch.setattr(cpu_kernels, "_shared_openmp", False)
    outs, calls, packed, layers = _linears_at(2, (1, 8, 100), monkeypatch)
    assert calls == []
    assert not isinstance(packed, onednn.Panels)
    w, w1, b1 = layers[0].weight, layers[1].weight, layers[1].bias
    for rows, got in zip((1, 8, 100), outs, strict=True):
        x = torch.randn(rows, 32, generator=torch.Generator().manual_seed(rows))
        wants = [F.linear(x, w1, b1)] * 2 + [F.linear(x, w)]
        for out, want in zip(got, wants, strict=True):
            torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
    assert isinstance(onednn.pack_weight(w), onednn.Panels)  # one thread again


def test_the_kernels_run_on_torchs_own_threads():
    """The kernels' OpenMP runtime is torch's: a split starts no thread of its own (a second
    runtime would start a second set, competing with torch's)."""
    import os

    assert cpu_kernels.library() is not None and cpu_kernels.torch_openmp()
    runtimes = cpu_kernels._openmp_runtimes()
    assert len(runtimes) == 1, runtimes
    gen = torch.Generator().manual_seed(2)
    w = torch.randn(4096, 256, generator=gen)
    panels = cpu_kernels.pack_panels(w)
    x = torch.randn(64, 256, generator=gen)
    torch.set_num_threads(2)
    try:
        assert cpu_kernels.kernel_threads() == 2
        torch.randn(4096, 4096, generator=gen).sum()  # torch's pool is up
        before = len(os.listdir("/proc/self/task"))
        for _ in range(3):
            two = cpu_kernels.panel_linear(x, panels, 4096)
        after = len(os.listdir("/proc/self/task"))
    finally:
        torch.set_num_threads(1)
    assert after == before
    assert cpu_kernels._openmp_runtimes() == runtimes
    assert torch.equal(two, cpu_kernels.panel_linear(x, panels, 4096))


@pytest.mark.parametrize("n, k", [(96, 64), (33, 517), (4, 3), (2048, 512)])  # panel tails
def test_panel_linear_against_float64_and_alike_in_any_batch(n, k):
    gen = torch.Generator().manual_seed(n + k)
    w = torch.randn(n, k, generator=gen)
    b = torch.randn(n, generator=gen)
    panels = cpu_kernels.pack_panels(w)
    width = cpu_kernels.panel_width()
    assert panels is not None and panels.shape == (-(-n // width), k, width)
    x = torch.randn(19, k, generator=gen)  # two tiles of 8 rows and a tail of 3
    got = cpu_kernels.panel_linear(x, panels, n, b)
    assert got is not None and got.shape == (19, n)
    exact = x.double() @ w.double().t() + b.double()
    scale = (x.double().abs() @ w.double().abs().t()).max().item() + 1
    assert (got.double() - exact).abs().max().item() / scale <= 1e-6
    # a row's result is the same alone, in any batch, at any place in a tile
    for rows in (slice(0, 1), slice(5, 6), slice(3, 12), slice(18, 19)):
        assert torch.equal(cpu_kernels.panel_linear(x[rows], panels, n, b), got[rows])
    three_d = cpu_kernels.panel_linear(x.view(1, 19, k), panels, n, None)
    assert torch.equal(three_d[0], cpu_kernels.panel_linear(x, panels, n))


def test_panel_linear_rows_in_blocks_are_the_rows_alone():
    """Many rows go in blocks that fit the cache (64 rows of 1,024 floats): every row, in
    whichever block and tile it falls, equals the row computed alone."""
    gen = torch.Generator().manual_seed(5)
    w, x = torch.randn(70, 1024, generator=gen), torch.randn(203, 1024, generator=gen)
    panels = cpu_kernels.pack_panels(w)
    got = cpu_kernels.panel_linear(x, panels, 70)
    for r in (0, 63, 64, 130, 202):
        assert torch.equal(cpu_kernels.panel_linear(x[r : r + 1], panels, 70), got[r : r + 1])
    torch.testing.assert_close(got, x @ w.t(), rtol=1e-5, atol=1e-4)


def test_panel_linear_declines_what_it_does_not_take():
    w = torch.randn(40, 16)
    panels = cpu_kernels.pack_panels(w)
    x = torch.randn(2, 16)
    assert cpu_kernels.pack_panels(w.half()) is None
    assert cpu_kernels.panel_linear(x.bfloat16(), panels, 40) is None  # not the panels' dtype
    assert cpu_kernels.panel_linear(x, panels, 65) is None  # more outputs than the panels hold
    assert cpu_kernels.panel_linear(x, panels, 32) is None  # a whole panel fewer
    assert cpu_kernels.panel_linear(torch.randn(2, 8), panels, 40) is None
    assert cpu_kernels.panel_linear(x, panels, 40, torch.randn(39)) is None
    assert cpu_kernels.panel_linear(x[:0], panels, 40) is None


def _count_calls(monkeypatch, name: str) -> list[int]:
    """Patch the kernel `name` to record each call (a 1) in the list returned."""
    calls: list[int] = []
    real = getattr(cpu_kernels, name)

    def counting(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(cpu_kernels, name, counting)
    return calls


def _decode_case(dtype, hq, hkv, d, bs, positions, window, chunk, seed=0):
    """A pool whose every slot a row may not see holds NaN, the rows' plan, and q/k/v."""
    from hybrid_pd.engine.batch import SeqInfo
    from hybrid_pd.engine.paged_attention import _decode_rows

    gen = torch.Generator().manual_seed(seed)
    need = [p // bs + 1 for p in positions]
    perm = (torch.randperm(sum(need) + 3, generator=gen) + 1).tolist()  # blocks out of order
    tables, at = [], 0
    for n in need:
        tables.append(perm[at : at + n])
        at += n
    cache = torch.full((sum(need) + 4, 2, bs, hkv, d), float("nan"))
    for table, p in zip(tables, positions, strict=True):
        lo = 0 if window is None else max(0, p - window + 1)
        lo = lo if chunk is None else max(lo, p // chunk * chunk)
        for pos in range(lo, p):  # visible keys; the new token's own is written by the call
            cache[table[pos // bs], :, pos % bs] = torch.randn(2, hkv, d, generator=gen)
    seqs = [
        SeqInfo(f"r{i}", i, 1, p, (table,))
        for i, (p, table) in enumerate(zip(positions, tables, strict=True))
    ]
    rows = _decode_rows(seqs, 0, bs, window, chunk, "cpu", whole=True)
    s = len(positions)
    q, k, v = (torch.randn(s, h, d, generator=gen) for h in (hq, hkv, hkv))
    return cache.to(dtype), rows, q.to(dtype), k.to(dtype), v.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "hq, hkv, d",
    [(8, 2, 64), (6, 2, 24), (8, 1, 16), (4, 4, 32)],  # G of 4, 3, 8 and 1; D with tails
)
@pytest.mark.parametrize(
    "window, chunk, softcap, sinks",
    [
        (None, None, None, False),
        (5, None, None, False),
        (None, 8, None, False),
        (None, None, 20.0, False),
        (7, None, None, True),
    ],
)
def test_decode_attention_equals_the_gather_and_sdpa(
    dtype, hq, hkv, d, window, chunk, softcap, sinks, monkeypatch
):
    """The kernel against the batched decode path it replaces (gather, mask, SDPA or
    explicit scores), rows of many lengths over blocks out of order, every slot a row may
    not see holding NaN (the kernel must never read it)."""
    from hybrid_pd.engine import paged_attention

    positions = [0, 3, 17, 40, 63, 2]
    cache, rows, q, k, v = _decode_case(dtype, hq, hkv, d, 4, positions, window, chunk)
    sink = torch.randn(hq).to(dtype) if sinks else None
    scale = d**-0.5
    calls = _count_calls(monkeypatch, "decode_attention")
    got = paged_attention._attend_rows(q, k, v, cache.clone(), rows, scale, softcap, sink)
    assert calls == [1]
    monkeypatch.setattr(cpu_kernels, "decode_attention", lambda *a, **kw: None)
    want = paged_attention._attend_rows(q, k, v, cache.clone(), rows, scale, softcap, sink)
    assert got.dtype is dtype and got.shape == want.shape
    assert torch.isfinite(got).all()
    tol = 2e-6 if dtype is torch.float32 else 2e-2
    assert (got.float() - want.float()).abs().max().item() <= tol * want.float().abs().max()


def test_decode_attention_declines_what_it_does_not_take():
    cache, rows, q, _, _ = _decode_case(torch.float32, 4, 2, 16, 4, [3, 9], None, None)
    args = (rows.read, rows.lo, rows.hi, 0.25)
    assert cpu_kernels.decode_attention(q, cache, *args) is not None
    assert cpu_kernels.decode_attention(q.bfloat16(), cache, *args) is None  # mixed types
    assert cpu_kernels.decode_attention(q.double(), cache.double(), *args) is None
    assert cpu_kernels.decode_attention(q[:, :3], cache, *args) is None  # 3 heads over 2
    assert cpu_kernels.decode_attention(q, cache[..., :8], *args) is None  # head dims differ
    wrong = (rows.read, rows.lo.long(), rows.hi, 0.25)
    assert cpu_kernels.decode_attention(q, cache, *wrong) is None
    full = cache.nan_to_num(0.5)  # the new tokens' own slots hold values too
    one = cpu_kernels.decode_attention(q, full, *args)
    assert not one.isnan().any()
    torch.set_num_threads(2)
    try:
        # split over torch's threads by sequence: the same sums, bit for bit
        assert torch.equal(cpu_kernels.decode_attention(q, full, *args), one)
        # no runtime shared with torch: one thread of ours would sit beside torch's idle
        # ones, so the PyTorch path (which splits over them) takes it
        cpu_kernels._shared_openmp = False
        assert cpu_kernels.decode_attention(q, cache, *args) is None
    finally:
        cpu_kernels._shared_openmp = True
        torch.set_num_threads(1)


def _prompt_case(hq, hkv, d, bs, done, n, window, chunk, seed=0):
    """A pool whose every slot the chunk may not read holds NaN, the chunk's plan (n new
    tokens after `done`), and its q/k/v."""
    from hybrid_pd.engine.batch import SeqInfo
    from hybrid_pd.engine.paged_attention import _first_key, _seq_plan

    gen = torch.Generator().manual_seed(seed)
    need = (done + n - 1) // bs + 1
    table = (torch.randperm(need + 3, generator=gen) + 1)[:need].tolist()  # out of order
    cache = torch.full((need + 4, 2, bs, hkv, d), float("nan"))
    for pos in range(_first_key(done, window, chunk), done):  # keys of earlier chunks
        cache[table[pos // bs], :, pos % bs] = torch.randn(2, hkv, d, generator=gen)
    plan = _seq_plan(SeqInfo("r", 0, n, done, (table,)), table, bs, window, chunk, "cpu")
    q, k, v = (torch.randn(n, h, d, generator=gen) for h in (hq, hkv, hkv))
    return cache, plan, q, k, v


@pytest.mark.parametrize(
    "hq, hkv, d",
    [(8, 2, 64), (6, 2, 24), (16, 1, 80), (4, 4, 32)],  # G of 4, 3, 16 and 1; D with tails
)
@pytest.mark.parametrize(
    "done, n, window, chunk, softcap, sinks",
    [
        (0, 300, None, None, None, False),  # a prompt from its start: the causal square
        (0, 200, 48, None, None, False),  # longer than the window
        (90, 77, 40, None, 20.0, False),  # a later chunk, window and soft cap
        (37, 130, None, 32, None, True),  # chunked attention with sinks
        (5, 1, None, None, None, False),
        (0, 3, 7, None, None, True),
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prompt_attention_equals_the_sdpa_path(
    hq, hkv, d, done, n, window, chunk, softcap, sinks, dtype, monkeypatch
):
    """The kernel against the prompt path it replaces (gather, then SDPA or explicit
    scores), over blocks out of order, every slot the chunk may not read holding NaN. In
    bfloat16 it computes in float32 and rounds its output once: the float32 path on the
    same (bfloat16) values, within that rounding."""
    from hybrid_pd.engine import paged_attention

    cache, plan, q, k, v = _prompt_case(hq, hkv, d, 4, done, n, window, chunk)
    cache, q, k, v = (t.to(dtype) for t in (cache, q, k, v))
    sink = torch.randn(hq) if sinks else None
    scale = d**-0.5
    calls = _count_calls(monkeypatch, "prompt_attention")
    got = paged_attention._attend_seq(q, k, v, cache.clone(), plan, scale, softcap, sink)
    assert calls == [1] and got.dtype is dtype
    monkeypatch.setattr(cpu_kernels, "prompt_attention", lambda *a, **kw: None)
    q, k, v, cache = q.float(), k.float(), v.float(), cache.float()
    want = paged_attention._attend_seq(q, k, v, cache.clone(), plan, scale, softcap, sink)
    assert got.shape == want.shape and torch.isfinite(got).all()
    err = (got.float() - want).abs()
    if dtype is torch.float32:
        assert err.max().item() <= 2e-6 * want.abs().max().item()
    else:  # half a bfloat16 step of each output, and float32's sums
        assert (err <= 2.0**-8 * want.abs() + 2e-6 * want.abs().max()).all()


def test_prompt_attention_split_over_threads_and_what_it_declines():
    cache, plan, q, k, v = _prompt_case(8, 2, 64, 16, 40, 300, 100, None)
    cache[plan.blocks, 0, plan.slots] = k
    cache[plan.blocks, 1, plan.slots] = v
    args = (plan.read, plan.offset, plan.lo, plan.own_key, 0.125)
    one = cpu_kernels.prompt_attention(q, cache, *args)
    assert one is not None and torch.isfinite(one).all()
    assert cpu_kernels.prompt_attention(q.bfloat16(), cache, *args) is None  # mixed types
    assert cpu_kernels.prompt_attention(q.double(), cache.double(), *args) is None
    assert cpu_kernels.prompt_attention(q[:, :3], cache, *args) is None  # 3 heads over 2
    assert cpu_kernels.prompt_attention(q, cache[..., :32], *args) is None
    wrong = (plan.read, plan.offset, plan.lo.long(), plan.own_key, 0.125)
    assert cpu_kernels.prompt_attention(q, cache, *wrong) is None
    assert cpu_kernels.prompt_attention(q[:-1], cache, *args) is None  # a query without lo
    torch.set_num_threads(2)
    try:
        # split by KV head and block of queries, each computed whole by one thread
        assert cpu_kernels.kernel_threads() == 2
        assert torch.equal(cpu_kernels.prompt_attention(q, cache, *args), one)
        cpu_kernels._shared_openmp = False
        assert cpu_kernels.prompt_attention(q, cache, *args) is None
    finally:
        cpu_kernels._shared_openmp = True
        torch.set_num_threads(1)


@pytest.mark.parametrize("norm", [None, 0.0, 1.0])  # no norm; weight; (1 + weight)
@pytest.mark.parametrize("rot", [64, 32])  # all of the head; its first half
def test_norm_rotate_equals_the_norm_then_rotate(norm, rot, monkeypatch):
    """The one-pass kernel against RMSNorm then `rotate`, on heads that are a view of a
    fused projection's output (rows wider than the heads)."""
    from hybrid_pd.engine.models.common import RMSNorm
    from hybrid_pd.engine.models.rope import cos_sin, norm_rotate

    gen = torch.Generator().manual_seed(5)
    fused = torch.randn(37, 8 * 64 + 2 * 64, generator=gen) * 3
    x = fused[:, : 8 * 64].view(37, 8, 64)
    module = None
    if norm is not None:
        module = RMSNorm(64, 1e-6, offset=norm)
        module.weight.data = torch.randn(64, generator=gen) * 0.5 + (0 if norm else 1)
    inv = 1.0 / (10000 ** (torch.arange(0, rot, 2).float() / rot))
    cos, sin = cos_sin(inv, torch.arange(100, 137), 1.0, torch.float32)
    calls = _count_calls(monkeypatch, "norm_rope")
    got = norm_rotate(x, cos, sin, module)
    assert calls == [1] and got.is_contiguous()
    monkeypatch.setattr(cpu_kernels, "norm_rope", lambda *a, **kw: None)
    want = norm_rotate(x, cos, sin, module)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    if rot < 64 and norm is None:  # the dims past the rotation are the input's
        assert torch.equal(got[..., rot:], x[..., rot:])


def test_norm_rope_declines_what_it_does_not_take():
    x, cos = torch.randn(4, 2, 8), torch.randn(4, 1, 8)
    assert cpu_kernels.norm_rope(x, cos, cos) is not None
    assert cpu_kernels.norm_rope(x.bfloat16(), cos, cos) is None
    assert cpu_kernels.norm_rope(x, cos.bfloat16(), cos.bfloat16()) is None
    assert cpu_kernels.norm_rope(x, cos[:3], cos[:3]) is None  # a token without its angle
    assert cpu_kernels.norm_rope(x, torch.randn(4, 1, 10), torch.randn(4, 1, 10)) is None
    assert cpu_kernels.norm_rope(x, cos[..., :3], cos[..., :3]) is None  # odd rotary dims
    assert cpu_kernels.norm_rope(x, cos, cos, torch.randn(7)) is None
    assert (
        cpu_kernels.norm_rope(torch.randn(2, 1, 2048), torch.randn(2, 1, 8), torch.randn(2, 1, 8))
        is None
    )


@pytest.mark.parametrize("bias", [False, True])
def test_conv_silu_equals_the_shifted_multiply_adds(bias):
    """Mamba2's prompt convolution: two sequences' windows side by side (K - 1 earlier
    inputs, then the new ones), the kernel against the PyTorch form it replaces."""
    gen = torch.Generator().manual_seed(8)
    taps, channels, lengths = 4, 200, [37, 5]
    window = torch.randn(sum(n + taps - 1 for n in lengths), channels, generator=gen) * 2
    weight = torch.randn(taps, channels, generator=gen)
    b = torch.randn(channels, generator=gen) if bias else None
    first = torch.cat([torch.arange(37), torch.arange(5) + 37 + taps - 1])
    got = cpu_kernels.conv_silu(window, weight, b, first)
    span = window.shape[0] - taps + 1
    conv = torch.zeros(span, channels) if b is None else b.expand(span, channels).clone()
    for k in range(taps):
        conv.addcmul_(window[k : k + span], weight[k])
    want = torch.nn.functional.silu(conv.index_select(0, first))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert cpu_kernels.conv_silu(window, weight, b, first + span) is None  # past the end
    assert cpu_kernels.conv_silu(window.double(), weight, b, first) is None
    assert cpu_kernels.conv_silu(window, weight[:, :10], b, first) is None
    assert cpu_kernels.conv_silu(window, weight, b, first.int()) is None
    assert cpu_kernels.conv_silu(window.t(), weight, b, first) is None


def test_conv_steps_equal_the_prompt_convolution_bit_for_bit():
    """A token's convolution output and the state it leaves are the same bits whether the
    token came in a prompt (`conv_silu`) or in decode steps (`conv_step_silu`), alone or in
    a batch whose states lie as gathered pool rows: how a request's tokens were cut into
    chunks, steps and batches changes no bit of its Mamba2 convolution."""
    gen = torch.Generator().manual_seed(12)
    taps, channels, n = 4, 96, 9
    weight = torch.randn(channels, taps, generator=gen)  # conv1d's [C, K]
    bias = torch.randn(channels, generator=gen)
    state0 = torch.randn(channels, taps - 1, generator=gen)
    x = torch.randn(n, channels, generator=gen) * 2
    window = torch.cat([state0.t(), x])  # [K - 1 + n, C]
    prompt = cpu_kernels.conv_silu(window, weight.t().contiguous(), bias, torch.arange(n))
    state = state0.clone()[None]
    for t in range(n):
        step = cpu_kernels.conv_step_silu(state, x[t : t + 1], weight, bias)
        assert torch.equal(step[0], prompt[t])
    assert torch.equal(state[0], window[-(taps - 1) :].t())
    # three sequences in one step, their states apart as gathered rows lie
    rows = torch.stack([state0, state0 * 0.5, state0 * 2])
    pool = torch.zeros(3, 2, channels, taps - 1)
    pool[:, 1] = rows
    out = cpu_kernels.conv_step_silu(pool[:, 1], x[:3], weight, None)
    for s in range(3):
        alone = rows[s].clone()[None]
        assert torch.equal(out[s], cpu_kernels.conv_step_silu(alone, x[s : s + 1], weight, None)[0])
        assert torch.equal(pool[s, 1], alone[0])
    assert not pool[:, 0].any()
    # the PyTorch form it replaces: the window times the weights, summed, then SiLU
    want = torch.nn.functional.silu((torch.cat([rows, x[:3, :, None]], 2) * weight).sum(-1))
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-6)
    assert cpu_kernels.conv_step_silu(rows.transpose(1, 2), x[:3], weight, None) is None
    assert cpu_kernels.conv_step_silu(rows.double(), x[:3], weight, None) is None
    assert cpu_kernels.conv_step_silu(rows, x[:2], weight, None) is None
    assert cpu_kernels.conv_step_silu(rows, x[:3], weight[:, :3], None) is None


@pytest.mark.slow
def test_engine_processes_starting_together_build_the_kernels_once(tmp_path):
    """Three processes ask for the kernels at once on a machine without them: one
    compiles, the others wait for its library (they log no build of their own)."""
    import subprocess
    import sys

    code = (
        "import logging, sys; logging.basicConfig(level=logging.INFO, stream=sys.stderr);"
        "from hybrid_pd.engine import cpu_kernels; assert cpu_kernels.library() is not None"
    )
    env = {**os.environ, "HYBRID_PD_KERNEL_CACHE": str(tmp_path)}
    procs = [
        subprocess.Popen([sys.executable, "-c", code], env=env, stderr=subprocess.PIPE, text=True)
        for _ in range(3)
    ]
    logs = [p.communicate(timeout=300)[1] for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0], logs
    assert sum(log.count("building the CPU kernels") for log in logs) == 1, logs
    assert len(list(tmp_path.glob("cpu_kernels-*.so"))) == 1
    assert not list(tmp_path.glob(".build-*"))  # no half-built leftovers
