"""The Mamba1 (selective scan) mixer of Jamba on the paged pool.

Per sequence, with the per-layer state [conv_state [inner, K-1], ssm [inner, N]]:
  in_proj -> (x, z); x goes through a depthwise causal conv (the conv state supplies the K-1
  previous inputs) and the activation; x_proj -> (dt_r, B, C), each RMS-normed (Jamba's
  dt / B / C layernorms); dt = softplus(dt_proj(dt_r)); A = -exp(A_log) [inner, N];
  h_t = exp(dt_t A) h_{t-1} + (dt_t x_t) B_t, y_t = h_t C_t + D x_t; then y * silu(z) goes
  through out_proj.

Several new tokens run the recurrence token by token (vectorised over channels); a batch's
one-token sequences take one step together on stacked states (one gather from the pool, one
scatter back). The SSM math runs in float32; the state pages keep their own dtypes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from hybrid_pd.engine.batch import ForwardBatch, SeqInfo
from hybrid_pd.engine.models.common import RMSNorm, activation
from hybrid_pd.engine.paged import (
    StateRows,
    read_state,
    read_state_rows,
    split_state_seqs,
    write_state,
    write_state_rows,
)


@dataclass(frozen=True)
class Mamba1Dims:
    """Sizes and switches of one Mamba1 mixer."""

    hidden: int
    inner: int
    state: int
    conv_kernel: int
    dt_rank: int
    eps: float
    act: str = "silu"
    conv_bias: bool = True
    proj_bias: bool = False


class Mamba1Mixer(nn.Module):
    """Checkpoint names: in_proj, conv1d, x_proj, dt_proj, A_log, D, out_proj,
    dt_layernorm, b_layernorm, c_layernorm."""

    def __init__(self, d: Mamba1Dims, name: str) -> None:
        super().__init__()
        self.name = name
        self.inner, self.state, self.dt_rank = d.inner, d.state, d.dt_rank
        self.in_proj = nn.Linear(d.hidden, 2 * d.inner, bias=d.proj_bias)
        self.conv1d = nn.Conv1d(d.inner, d.inner, d.conv_kernel, groups=d.inner, bias=d.conv_bias)
        self.x_proj = nn.Linear(d.inner, d.dt_rank + 2 * d.state, bias=False)
        self.dt_proj = nn.Linear(d.dt_rank, d.inner, bias=True)
        self.A_log = nn.Parameter(torch.zeros(d.inner, d.state))
        self.D = nn.Parameter(torch.ones(d.inner))
        self.out_proj = nn.Linear(d.inner, d.hidden, bias=d.proj_bias)
        self.dt_layernorm = RMSNorm(d.dt_rank, d.eps, scale_after_cast=True)
        self.b_layernorm = RMSNorm(d.state, d.eps, scale_after_cast=True)
        self.c_layernorm = RMSNorm(d.state, d.eps, scale_after_cast=True)
        self.act = activation(d.act)

    def forward(self, h: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        x, z = self.in_proj(h).chunk(2, dim=-1)
        a_coef = -torch.exp(self.A_log.float())
        rows, rest = split_state_seqs(self.name, batch)
        if rows is not None and not rest:  # every sequence adds one token, in row order
            y = self._step_rows(batch, rows, x, a_coef)
        else:
            y = torch.empty(h.shape[0], self.inner, device=h.device, dtype=torch.float32)
            if rows is not None:
                t = rows.tokens
                y[t] = self._step_rows(batch, rows, x[t], a_coef)
            for seq in rest:
                sl = slice(seq.start, seq.end)
                y[sl] = self._sequence(batch, seq, x[sl], a_coef)
        y = y * F.silu(z.float())
        return self.out_proj(y.to(h.dtype))

    def _ssm_inputs(self, xc: torch.Tensor):
        """Activated conv output [L, inner] -> dt [L, inner], b and c [L, N] (float32)."""
        dt_r, b, c = self.x_proj(xc).split([self.dt_rank, self.state, self.state], dim=-1)
        dt_r, b, c = self.dt_layernorm(dt_r), self.b_layernorm(b), self.c_layernorm(c)
        dt = F.linear(dt_r, self.dt_proj.weight).float() + self.dt_proj.bias.float()
        return F.softplus(dt), b.float(), c.float()

    def _step_rows(self, batch, rows: StateRows, x, a_coef) -> torch.Tensor:
        """One token for each of S sequences (x [S, inner]) on stacked states, gathered from
        and scattered back to the pool once."""
        conv_state, ssm_state = read_state_rows(self.name, batch, rows)
        window = torch.cat([conv_state.to(x.dtype), x[:, :, None]], dim=2)  # [S, inner, K]
        conv = (window * self.conv1d.weight[:, 0]).sum(-1)
        if self.conv1d.bias is not None:
            conv = conv + self.conv1d.bias
        xc = self.act(conv)
        dt, b, c = self._ssm_inputs(xc)
        xf = xc.float()
        state = ssm_state.float() * torch.exp(dt[..., None] * a_coef)
        state = state + (dt * xf)[..., None] * b[:, None, :]
        # state @ c as c^T @ state^T: a batch of [1, N] @ [N, inner] is 4x faster on CPU
        y = (c[:, None, :] @ state.transpose(-1, -2))[:, 0] + xf * self.D.float()
        write_state_rows(self.name, batch, rows, [window[:, :, 1:], state])
        return y

    def _sequence(self, batch, seq: SeqInfo, x, a_coef) -> torch.Tensor:
        conv_state, ssm_state = read_state(self.name, batch, seq)
        # depthwise causal conv over [K-1 previous inputs | new inputs]
        window = torch.cat([conv_state.to(x.dtype), x.t()], dim=1)  # [inner, K-1+L]
        new_conv = window[:, window.shape[1] - conv_state.shape[1] :]
        conv = F.conv1d(window[None], self.conv1d.weight, self.conv1d.bias, groups=self.inner)
        xc = self.act(conv[0].t())  # [L, inner]
        dt, b, c = self._ssm_inputs(xc)
        xf = xc.float()
        decay = torch.exp(dt[..., None] * a_coef)  # [L, inner, N]
        inputs = (dt * xf)[..., None] * b[:, None, :]  # [L, inner, N]
        state = ssm_state.float()
        ys = []
        for i in range(xf.shape[0]):  # the recurrence, vectorised over channels and state
            state = decay[i] * state + inputs[i]
            ys.append(state @ c[i])
        y = torch.stack(ys) + xf * self.D.float()
        write_state(
            self.name, batch, seq, [new_conv.to(conv_state.dtype), state.to(ssm_state.dtype)]
        )
        return y


def check_state_spec(d: Mamba1Dims, spec: object, layer: str, arch: str) -> None:
    """Raise ValueError unless `spec` (the layer's cache spec) is the state page of `d`."""
    want = ((d.inner, d.conv_kernel - 1), (d.inner, d.state))
    shapes = getattr(spec, "shapes", None)
    if (
        shapes is None
        or tuple(tuple(s) for s in shapes) != want
        or getattr(spec, "mamba_type", None) != "mamba1"
    ):
        raise ValueError(
            f"{arch}: {layer} is a Mamba1 layer of state shapes {want}, but its cache spec "
            f"is {spec!r}"
        )
