"""The Gated DeltaNet mixer of Qwen3.5 and Qwen3-Next (`qwen3_5.py` builds the models).

``in_proj_qkv`` feeds a depthwise causal conv1d (kernel K, SiLU) whose state is the last
K - 1 inputs; q/k are L2-normalised, q scaled by 1/sqrt(d_k); per head a decay
``g = -exp(A_log) * softplus(a + dt_bias)`` and a write strength ``beta = sigmoid(b)`` drive
the gated delta rule on a [d_k, d_v] state:
``S <- exp(g) S;  S <- S + k (beta (v - S^T k))^T;  o = S^T q``. The output goes through an
RMS norm gated by ``silu(in_proj_z(x))`` and ``out_proj``. With ``fused`` (Qwen3-Next) the
input projections are ``in_proj_qkvz`` and ``in_proj_ba``, grouped per key head (see
`qwen3_5.py`'s docstring for the row layout).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from hybrid_pd.engine import cpu_kernels
from hybrid_pd.engine.batch import ForwardBatch
from hybrid_pd.engine.models.common import (
    activation,
    causal_exp_floor,
    exp_or_zero,
)
from hybrid_pd.engine.onednn import FusedLinears
from hybrid_pd.engine.paged import (
    StateRows,
    read_state,
    read_state_rows,
    split_state_seqs,
    state_rows_in_place,
    vec_times_rows,
    write_state,
    write_state_rows,
)

GDN_CHUNK = 64  # tokens per block of the chunked (parallel) delta rule


def _l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + eps)


def delta_rule_step(q, k, v, g, beta, state):
    """One token. q/k [H, dk], v [H, dv], g/beta [H], state [H, dk, dv] (fp32) -> (o, state)."""
    state = state * g.exp()[:, None, None]
    predicted = torch.einsum("hk,hkv->hv", k, state)
    delta = beta[:, None] * (v - predicted)
    state = state + k[:, :, None] * delta[:, None, :]
    return torch.einsum("hk,hkv->hv", q, state), state


def delta_rule_rows(q, k, v, g, beta, state):
    """One token of S sequences at once: q/k [S, H, dk], v [S, H, dv], g/beta [S, H], state
    [S, H, dk, dv] (fp32; updated in place) -> (o [S, H, dv], state)."""
    state.mul_(g.exp()[:, :, None, None])
    delta = beta[:, :, None] * (v - vec_times_rows(k, state))
    state.addcmul_(k[..., None], delta[:, :, None, :])
    return vec_times_rows(q, state), state


def delta_rule_chunked(q, k, v, g, beta, state, chunk: int = GDN_CHUNK):
    """Several tokens, in blocks of `chunk`. q/k [H, n, dk], v [H, n, dv], g/beta [H, n],
    state [H, dk, dv] (all fp32) -> (o [H, n, dv], final state).

    Inside a block with cumulative log decay G, the deltas U written by each token solve the
    unit lower-triangular system (I + A) U = beta V - beta exp(G) K S0 with
    A[i, j] = beta_i exp(G_i - G_j) k_i.k_j (j < i); outputs and the end state follow from U.
    """
    h, n, dk = q.shape
    dv = v.shape[-1]
    out = q.new_empty(h, n, dv)
    # strong decays make many exp results that are 0 (slow on CPU): exp_or_zero sets them,
    # and the entries above the diagonal with them (floor +inf)
    floor = causal_exp_floor(chunk, q.device)
    # each block's right-hand sides [beta V | beta exp(G) K], written in place (no cat)
    rhs_buffer = q.new_empty(h, min(chunk, n), dv + dk)
    for lo in range(0, n, chunk):
        hi = min(n, lo + chunk)
        qc, kc, vc, bc = q[:, lo:hi], k[:, lo:hi], v[:, lo:hi], beta[:, lo:hi]
        cum = g[:, lo:hi].cumsum(-1)  # [H, L]
        size = hi - lo
        rel = exp_or_zero(cum[:, :, None] - cum[:, None, :], floor[:size, :size])
        kt = kc.transpose(-1, -2)
        system = (kc @ kt).mul_(bc[:, :, None]).mul_(rel).tril_(-1)
        system.diagonal(dim1=-2, dim2=-1).fill_(1.0)
        grow = exp_or_zero(cum.clone())
        rhs = rhs_buffer[:, :size]
        torch.mul(bc[..., None], vc, out=rhs[..., :dv])
        torch.mul((bc * grow)[..., None], kc, out=rhs[..., dv:])
        # solved = system^-1 rhs, computed as solved^T = rhs^T (system^T)^-1 on transposed
        # views: the same LAPACK solve without copying to column-major, 1.8x faster on CPU
        # ([8, 64, 64] with 128 right-hand sides: 192 against 346 us, one thread)
        solved = torch.linalg.solve_triangular(
            system.transpose(-1, -2),
            rhs.transpose(-1, -2),
            upper=True,
            left=False,
            unitriangular=True,
        ).transpose(-1, -2)
        # fused multiply-adds (baddbmm) where a product meets a sum: fewer passes
        deltas = torch.baddbmm(solved[..., :dv], solved[..., dv:], state, alpha=-1)  # [H, L, dv]
        scores = (qc @ kt).mul_(rel)
        out[:, lo:hi] = torch.baddbmm(scores @ deltas, qc * grow[..., None], state)
        # decay from each token to the block end
        tail = exp_or_zero(cum[:, -1:] - cum)[..., None]
        state = torch.baddbmm(
            state * grow[:, -1, None, None], (kc * tail).transpose(-1, -2), deltas
        )
    return out, state


# --------------------------------------------------------------------------- layers


class GatedRMSNorm(nn.Module):
    """RMS norm over the last dim, scaled by `weight`, then multiplied by silu(gate)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        fused = cpu_kernels.norm_gate(x, gate, self.weight, self.eps)  # the same, one pass
        if fused is not None:
            return fused
        dtype = x.dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        y = self.weight * xf.to(dtype)
        return (y * F.silu(gate.float())).to(dtype)


class GatedDeltaNet(nn.Module):
    def __init__(self, cfg: Mapping[str, Any], layer_name: str, fused: bool = False) -> None:
        super().__init__()
        hidden = int(cfg["hidden_size"])
        self.layer_name = layer_name
        self.k_heads = int(cfg["linear_num_key_heads"])
        self.v_heads = int(cfg["linear_num_value_heads"])
        self.dk = int(cfg["linear_key_head_dim"])
        self.dv = int(cfg["linear_value_head_dim"])
        if self.v_heads % self.k_heads:
            raise ValueError(
                "Qwen3.5 / Qwen3-Next: linear_num_value_heads must be a multiple of key heads"
            )
        self.key_dim = self.k_heads * self.dk
        self.value_dim = self.v_heads * self.dv
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.kernel = int(cfg.get("linear_conv_kernel_dim", 4))
        self.act = activation(cfg.get("hidden_act", "silu"))
        self.fused = fused
        if fused:  # Qwen3-Next: rows grouped per key head
            self.in_proj_qkvz = nn.Linear(hidden, self.conv_dim + self.value_dim, bias=False)
            self.in_proj_ba = nn.Linear(hidden, 2 * self.v_heads, bias=False)
            self._in_proj = FusedLinears(self.in_proj_qkvz, self.in_proj_ba)
        else:
            self.in_proj_qkv = nn.Linear(hidden, self.conv_dim, bias=False)
            self.in_proj_z = nn.Linear(hidden, self.value_dim, bias=False)
            self.in_proj_b = nn.Linear(hidden, self.v_heads, bias=False)
            self.in_proj_a = nn.Linear(hidden, self.v_heads, bias=False)
            self._in_proj = FusedLinears(
                self.in_proj_qkv, self.in_proj_z, self.in_proj_b, self.in_proj_a
            )
        self.conv1d = nn.Conv1d(
            self.conv_dim, self.conv_dim, self.kernel, groups=self.conv_dim, bias=False
        )
        self.dt_bias = nn.Parameter(torch.ones(self.v_heads))
        self.A_log = nn.Parameter(torch.zeros(self.v_heads))
        self.norm = GatedRMSNorm(self.dv, float(cfg.get("rms_norm_eps", 1e-6)))
        self.out_proj = nn.Linear(self.value_dim, hidden, bias=False)

    def _project(self, x: torch.Tensor):
        """x [t, hidden] -> conv input qkv [t, 2 key_dim + value_dim] (all q, all k, all v),
        gate z [t, Hv, dv], b and a [t, Hv]."""
        t = x.shape[0]
        if not self.fused:
            qkv, z, b, a = self._in_proj(x)
            return qkv, z.view(t, self.v_heads, self.dv), b, a
        r = self.v_heads // self.k_heads
        qkvz, ba = self._in_proj(x)
        qkvz = qkvz.view(t, self.k_heads, 2 * self.dk + 2 * r * self.dv)
        q, k, v, z = torch.split(qkvz, [self.dk, self.dk, r * self.dv, r * self.dv], -1)
        qkv = torch.cat([q.reshape(t, -1), k.reshape(t, -1), v.reshape(t, -1)], -1)
        b, a = ba.view(t, self.k_heads, 2 * r).split([r, r], -1)
        z = z.reshape(t, self.v_heads, self.dv)
        return qkv, z, b.reshape(t, self.v_heads), a.reshape(t, self.v_heads)

    def forward(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        t = x.shape[0]
        qkv, z, b, a = self._project(x)
        beta = b.sigmoid().float()
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)
        rows, rest = split_state_seqs(self.layer_name, batch)
        if rows is not None and not rest:  # every sequence adds one token, in row order
            core = self._step_rows(batch, rows, qkv, g, beta).to(x.dtype)
        else:
            core = x.new_empty(t, self.v_heads, self.dv)
            if rows is not None:
                r = rows.tokens
                core[r] = self._step_rows(batch, rows, qkv[r], g[r], beta[r]).to(core.dtype)
            for seq in rest:
                conv_state, ssm_state = read_state(self.layer_name, batch, seq)
                sl = slice(seq.start, seq.end)
                mixed, new_conv = self._conv(qkv[sl], conv_state)
                o, new_ssm = self._delta(mixed, g[sl], beta[sl], ssm_state.float())
                core[sl] = o.to(core.dtype)
                write_state(
                    self.layer_name,
                    batch,
                    seq,
                    [new_conv.to(conv_state.dtype), new_ssm.to(ssm_state.dtype)],
                )
        y = self.norm(core, z).reshape(t, self.value_dim)
        return self.out_proj(y)

    def _step_rows(self, batch: ForwardBatch, rows: StateRows, qkv, g, beta) -> torch.Tensor:
        """One token for each of S sequences: conv and delta-rule steps on the pool's state
        rows where they lie (C kernels), else on stacked states, gathered from and scattered
        back to the pool once."""
        out = self._step_in_place(batch, rows, qkv, g, beta)
        if out is not None:
            return out
        conv, state = read_state_rows(self.layer_name, batch, rows)
        weight = self.conv1d.weight[:, 0, :]  # [C, K]
        mixed = self._conv_step_kernel(conv, qkv, weight)
        if mixed is None:
            window = torch.cat([conv.to(weight.dtype), qkv.to(weight.dtype)[:, :, None]], dim=2)
            mixed = self.act((window * weight).sum(-1)).float()  # [S, C]
            # converted whole, then sliced: a converting copy from the strided slice is 4x
            # slower
            conv.copy_(window.to(conv.dtype)[:, :, 1:])
        q, k, v = self._qkv(mixed)
        # the gathered states are copies (or, not in float32, converted ones): update them
        # where they are and hand them back
        state = state.float()
        out = cpu_kernels.gdn_step(q, k, v, g, beta, state)
        if out is None:
            rep = self.v_heads // self.k_heads
            q, k = q.repeat_interleave(rep, dim=1), k.repeat_interleave(rep, dim=1)
            out, state = delta_rule_rows(q, k, v, g, beta, state)
        write_state_rows(self.layer_name, batch, rows, [conv, state])
        return out

    def _step_in_place(self, batch, rows: StateRows, qkv, g, beta) -> torch.Tensor | None:
        """`_step_rows` by the C kernels on each row's float32 state in its pool page (the
        same arithmetic as on stacked rows); None, the states untouched, where they do not
        apply."""
        paged = state_rows_in_place(self.layer_name, batch, rows) if self.act is F.silu else None
        if paged is None:
            return None
        (conv, state), ids = paged  # float32 (state_rows_in_place)
        weight = self.conv1d.weight[:, 0, :].float()
        mixed = cpu_kernels.conv_step_silu(conv, qkv.float(), weight, None, ids)
        if mixed is None:
            return None
        q, k, v = self._qkv(mixed)
        out = cpu_kernels.gdn_step(q, k, v, g, beta, state, ids)
        if out is None:  # the conv states took the token: the rule on copies of the rows
            rep = self.v_heads // self.k_heads
            q, k = q.repeat_interleave(rep, dim=1), k.repeat_interleave(rep, dim=1)
            out, own = delta_rule_rows(q, k, v, g, beta, state.index_select(0, ids))
            state.index_copy_(0, ids, own)
        return out

    def _qkv(self, mixed: torch.Tensor):
        """The conv's output [n, C] float32 -> q, k (L2-normed, q scaled by dk^-0.5) [n, Hk,
        dk] and v [n, Hv, dv]; on the CPU the norms are one C pass each (`l2_norm`)."""
        n = mixed.shape[0]
        q, k, v = torch.split(mixed, [self.key_dim, self.key_dim, self.value_dim], -1)
        qn = cpu_kernels.l2_norm(q, self.k_heads, self.dk**-0.5, 1e-6)
        kn = cpu_kernels.l2_norm(k, self.k_heads, 1.0, 1e-6)
        if qn is None or kn is None:
            qn = _l2norm(q.view(n, self.k_heads, self.dk)) * self.dk**-0.5
            kn = _l2norm(k.view(n, self.k_heads, self.dk))
        return qn, kn, v.view(n, self.v_heads, self.dv)

    def _conv_step_kernel(self, conv: torch.Tensor, qkv: torch.Tensor, weight: torch.Tensor):
        """The step's conv and SiLU in C, in float32 whatever the model's dtype (`conv_silu`'s
        arithmetic per token, as a prompt's `_conv`), `conv` [S, C, K-1] shifted in place;
        None where the kernel does not apply."""
        if self.act is not F.silu or conv.device.type != "cpu":
            return None
        if conv.stride(1) != conv.shape[2] or conv.stride(2) != 1:
            return None
        state = conv if conv.dtype is torch.float32 else conv.float()
        out = cpu_kernels.conv_step_silu(state, qkv.float(), weight.float(), None)
        if out is not None and state is not conv:
            conv.copy_(state)  # the inputs it keeps, exact in the state's dtype
        return out

    def _conv(self, x: torch.Tensor, conv_state: torch.Tensor):
        """x [n, C] new inputs, conv_state [C, K-1] past inputs -> (act(conv) [n, C], state).
        SiLU on the CPU: `conv_silu` over the window in float32 (a token's output the same
        bits as in a decode step's `conv_step_silu`, in every dtype)."""
        weight = self.conv1d.weight  # [C, 1, K]
        if self.act is F.silu and x.device.type == "cpu":
            window = torch.cat([conv_state.t().float(), x.float()])  # [K-1+n, C]
            first = torch.arange(x.shape[0], device=x.device)
            taps = weight[:, 0].float().t().contiguous()  # [K, C]
            out = cpu_kernels.conv_silu(window, taps, None, first)
            if out is not None:
                return out, window[window.shape[0] - (self.kernel - 1) :].t()
        seq = torch.cat([conv_state.to(weight.dtype), x.t().to(weight.dtype)], dim=1)
        out = F.conv1d(seq[None], weight, groups=self.conv_dim)[0]  # [C, n]
        keep = self.kernel - 1
        new_state = seq[:, seq.shape[1] - keep :]
        return self.act(out).t().to(x.dtype), new_state

    def _delta(self, mixed, g, beta, state):
        n = mixed.shape[0]
        q, k, v = self._qkv(mixed.float())
        # one token or many, the C kernel's arithmetic per token is that of a decode step
        # (`gdn_step`); it updates a state of its own (`state` may be the pool's)
        own = state.clone(memory_format=torch.contiguous_format)
        o = cpu_kernels.gdn_recurrent(q, k, v, g, beta, own)
        if o is not None:
            return o, own
        rep = self.v_heads // self.k_heads
        q = q.repeat_interleave(rep, dim=1)
        k = k.repeat_interleave(rep, dim=1)
        if n == 1:
            o, state = delta_rule_step(q[0], k[0], v[0], g[0], beta[0], state)
            return o[None], state
        o, state = delta_rule_chunked(
            q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), g.t(), beta.t(), state
        )
        return o.transpose(0, 1), state
