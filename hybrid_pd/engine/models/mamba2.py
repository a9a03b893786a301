"""The Mamba2 mixer on the paged pool, shared by the Mamba2 hybrids (Granite-4.0-H, Bamba,
Nemotron-H).

Per sequence, with the per-layer state [conv_state [conv_dim, K-1], ssm [H, P, N]]:
  in_proj -> (z, xBC, dt); xBC goes through a depthwise causal conv (the conv state supplies
  the K-1 previous inputs) and the activation and is split into x [H, P], B and C [G, N] (head
  h uses group h // (H / G)); dt = clamp(softplus(dt + dt_bias), time-step limit);
  A = -exp(A_log); h_t = exp(dt A) h_{t-1} + dt x_t B_t^T, y_t = h_t C_t + D x_t; then
  y * silu(z) goes through a per-group RMSNorm (norm after the gate) and out_proj. Several new
  tokens use the chunked SSD form with chunks of min(`chunk`, SCAN_CHUNK) tokens aligned to
  absolute positions, so a prefill split across steps uses the same chunk boundaries as one
  pass (the chunk size changes only float rounding); all sequences of a step that add several
  tokens go through one causal conv and one scan over all their chunks together; one new token
  uses the recurrence, and a batch's one-token sequences take it together on stacked states
  (one gather from the pool, one scatter back). The time-step limit is applied in both forms
  (transformers' torch decode path skips it; it matters only where softplus(dt + dt_bias)
  leaves the limit).

The SSM math runs in float32; the state page keeps its own dtype (Nemotron-H's float32
``mamba_ssm_cache_dtype`` included), the conv state the model's.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from hybrid_pd.engine import cpu_kernels
from hybrid_pd.engine.batch import ForwardBatch, SeqInfo
from hybrid_pd.engine.models.common import (
    activation,
    causal_exp_floor,
    config_int,
    exp_or_zero,
)
from hybrid_pd.engine.paged import (
    StateRows,
    read_state,
    read_state_rows,
    split_state_seqs,
    state_rounds,
    state_rows_in_place,
    vec_times_rows,
    write_state,
    write_state_rows,
)


def as_float(value: Any) -> float:
    """A JSON float, also as transformers writes non-finite ones ({"__float__": "Infinity"})."""
    if isinstance(value, dict):
        value = value.get("__float__", value)
    return float(value)


def time_step_limit(value: Any) -> tuple[float, float]:
    """A config's ``time_step_limit`` pair; None means no limit."""
    if value is None:
        return (0.0, math.inf)
    low, high = (as_float(v) for v in value)
    return (low, high)


@dataclass(frozen=True)
class Mamba2Dims:
    """Sizes and switches of one Mamba2 mixer; the inner size is heads * head_dim."""

    hidden: int
    heads: int
    head_dim: int
    groups: int
    state: int
    conv_kernel: int
    chunk: int
    eps: float
    act: str = "silu"
    conv_bias: bool = True
    proj_bias: bool = False
    dt_limit: tuple[float, float] = (0.0, math.inf)

    def __post_init__(self) -> None:
        if self.heads % self.groups:
            raise ValueError(f"Mamba2: {self.heads} heads do not split into {self.groups} groups")

    @classmethod
    def from_mamba_keys(
        cls,
        arch: str,
        c: Mapping[str, Any],
        hidden: int,
        inner: tuple[int, str],
        eps: float,
        act: str,
    ) -> Mamba2Dims:
        """The mixer of a config that names it with ``mamba_*`` keys (Bamba, Falcon-H1), of
        inner size ``inner[0]`` (``inner[1]`` names where it comes from in errors); the head
        dim is ``mamba_d_head``, or the inner size over the heads when "auto"."""
        size, source = inner
        heads = config_int(arch, "mamba_n_heads", c.get("mamba_n_heads", 128))
        head_dim = c.get("mamba_d_head", "auto")
        head_dim = size // heads if head_dim in (None, "auto") else int(head_dim)
        if head_dim * heads != size:
            raise ValueError(f"{arch}: mamba_n_heads * mamba_d_head must equal {source}")
        return cls(
            hidden=hidden,
            heads=heads,
            head_dim=head_dim,
            groups=config_int(arch, "mamba_n_groups", c.get("mamba_n_groups", 1)),
            state=config_int(arch, "mamba_d_state", c.get("mamba_d_state", 256)),
            conv_kernel=config_int(arch, "mamba_d_conv", c.get("mamba_d_conv", 4)),
            chunk=config_int(arch, "mamba_chunk_size", c.get("mamba_chunk_size", 256)),
            eps=eps,
            act=act,
            conv_bias=bool(c.get("mamba_conv_bias", True)),
            proj_bias=bool(c.get("mamba_proj_bias") or False),
            dt_limit=time_step_limit(c.get("time_step_limit", (0.0, math.inf))),
        )

    @property
    def inner(self) -> int:
        return self.heads * self.head_dim

    @property
    def conv_dim(self) -> int:
        return self.inner + 2 * self.groups * self.state


# Longest stretch of tokens the scan mixes through its [Q, Q] decay matrices. Its [Q, Q] work
# grows with Q while the per-chunk state work does not, so on CPU the scan is fastest with
# chunks shorter than the checkpoints' 128-256 (the chunk size changes only float rounding).
SCAN_CHUNK = 64


def _ssd_chunked(x, dt, a_coef, b, c, chunk: int, h0: torch.Tensor, offset: int):
    """Chunked SSD scan of one sequence (float32): `_ssd_packed` with one sequence.

    x [L, H, P], dt [L, H], a_coef [H] (negative), b/c [L, G, N] (G divides H), h0 [H, P, N].
    The first token sits at `offset` within its chunk. Returns y [L, H, P] (no D term) and
    the final state.
    """
    y, state = _ssd_packed(x, dt, a_coef, b, c, chunk, h0[None], [offset], [x.shape[0]])
    return y, state[0]


def _ssd_packed(x, dt, a_coef, b, c, chunk: int, h0, offsets: list[int], lengths: list[int]):
    """Chunked SSD scan of S sequences packed one after another (float32).

    x [T, H, P], dt [T, H], a_coef [H] (negative), b/c [T, G, N] with head h reading group
    h // (H / G), h0 [S, H, P, N]; sequence i has lengths[i] tokens, the first of them at
    offsets[i] within its chunk. Every sequence is padded to whole chunks and all chunks go
    through one set of batched ops. Returns y [T, H, P] (no D term) and the final states
    [S, H, P, N].
    """
    total, heads, hd = x.shape
    groups, n = b.shape[1:]
    per = heads // groups
    seqs = len(lengths)
    counts = [-(-(o + length) // chunk) for o, length in zip(offsets, lengths, strict=True)]
    nc = sum(counts)
    dev = x.device

    xdt, log_a = x * dt[..., None], dt * a_coef
    if not any(offsets) and all(length % chunk == 0 for length in lengths):
        where = None  # whole chunks already
    else:
        # one row per token, [x * dt | log_a | B | C], scattered into the padded chunks (zero
        # rows have dt = 0: no decay and no input, so padding leaves the scan unchanged)
        rows = torch.cat([xdt.flatten(1), log_a, b.flatten(1), c.flatten(1)], dim=1)
        first, starts = [], 0
        for o, count in zip(offsets, counts, strict=True):
            first.append(starts * chunk + o)
            starts += count
        lens = torch.tensor(lengths, device=dev)
        shift = torch.tensor(first, device=dev) - (lens.cumsum(0) - lens)
        where = torch.arange(total, device=dev) + shift.repeat_interleave(lens, output_size=total)
        padded = rows.new_zeros(nc * chunk, rows.shape[1]).index_copy_(0, where, rows)
        xdt, log_a, b, c = padded.split([heads * hd, heads, groups * n, groups * n], dim=-1)
    xdt = xdt.reshape(nc, chunk, heads, hd)  # [nc, Q, H, P]
    log_a = log_a.reshape(nc, chunk, heads)
    bq = b.reshape(nc, chunk, groups, n).transpose(1, 2)  # [nc, G, Q, N]
    cq = c.reshape(nc, chunk, groups, n).transpose(1, 2)

    # seg[c, h, s, l] = sum of log_a over s < k <= l, as a difference of float64 prefix sums.
    # A float64 sum of a chunk of float32 terms is exact unless their magnitudes span more than
    # ~2^20, so after the cast this matches summing each segment on its own (transformers'
    # masked cumulative sum, which accumulates in float64 on CPU too) without its [Q, Q]
    # cumulative sum. The subtraction writes float32 directly (computed in float64, rounded
    # once). Everything [Q, Q] below keeps this [c, h, s, l] layout so the elementwise work
    # runs on contiguous memory.
    prefix = log_a.double().cumsum(dim=1).transpose(1, 2)  # [nc, H, Q]
    seg = torch.empty(nc, heads, chunk, chunk, device=dev)
    torch.sub(prefix[:, :, None, :], prefix[:, :, :, None], out=seg)
    # strong decays make many entries that exp gives as 0 (slowly): exp_or_zero sets them
    # directly, and the non-causal ones (l < s) with them. The layout is [s, l] (from s to
    # l), so the floor is transposed.
    decay = exp_or_zero(seg, causal_exp_floor(chunk, dev).t())  # [nc, H, Q(s), Q(l)]
    # decay from s to the chunk's end, kept before the weights overwrite `decay`
    to_end = decay[..., -1].transpose(1, 2).clone()  # [nc, Q(s), H]

    # within a chunk: attention-like mixing with the decay as mask (B C^T is per group); the
    # weights take the decay's memory
    scores = torch.matmul(bq, cq.transpose(-1, -2))  # [nc, G, Q(s), Q(l)]
    weights = decay.view(nc, groups, per, chunk, chunk).mul_(scores[:, :, None])
    weights = weights.view(nc, heads, chunk, chunk)
    y = torch.matmul(weights.transpose(-1, -2), xdt.transpose(1, 2))  # [nc, H, Q(l), P]

    # what each chunk adds to the state by its end, starting from zero
    u = (xdt * to_end[..., None]).view(nc, chunk, groups, per * hd).permute(0, 2, 3, 1)
    added = torch.matmul(u, bq).view(nc, heads, hd, n)  # [nc, H, P, N]
    whole = torch.exp(prefix[:, :, -1].float())  # [nc, H]: decay over a whole chunk

    # the state each chunk starts from, all sequences stepping together
    most = max(counts)
    if len(set(counts)) == 1:
        added_s = added.view(seqs, most, heads, hd, n)
        whole_s = whole.view(seqs, most, heads)
        pick = None
    else:  # shorter sequences get trailing no-op chunks (decay 1, nothing added)
        pick = torch.tensor(
            [i * most + j for i, count in enumerate(counts) for j in range(count)], device=dev
        )
        added_s = added.new_zeros(seqs * most, heads, hd, n).index_copy_(0, pick, added)
        whole_s = whole.new_ones(seqs * most, heads).index_copy_(0, pick, whole)
        added_s = added_s.view(seqs, most, heads, hd, n)
        whole_s = whole_s.view(seqs, most, heads)
    start = torch.empty(seqs, most, heads, hd, n, device=dev)
    state = h0
    for j in range(most):
        start[:, j] = state
        state = torch.addcmul(added_s[:, j], state, whole_s[:, j, :, None, None])
    start = start.view(seqs * most, heads, hd, n)
    if pick is not None:
        start = start[pick]

    # contribution of the state each chunk starts from, scaled by the decay from the chunk's
    # start to each token
    from_start = exp_or_zero(prefix.float()).transpose(1, 2)  # [nc, Q(l), H]
    st = start.view(nc, groups, per * hd, n).transpose(-1, -2)  # [nc, G, N, per * P]
    ys = torch.matmul(cq, st).transpose(1, 2)  # [nc, Q(l), G, per * P]
    out = torch.empty(nc, chunk, heads, hd, device=dev)
    torch.addcmul(
        y.transpose(1, 2), ys.unflatten(-1, (per, hd)).flatten(2, 3), from_start[..., None], out=out
    )
    y = out.view(nc * chunk, heads, hd)
    if where is not None:
        y = y[where]
    return y, state


def _ssd_step(x, dt, a_coef, b, c, h0, in_place: bool = False):
    """One recurrent step of S sequences: x [S, H, P], dt [S, H], b/c [S, G, N] (head h
    reads group h // (H / G)), h0 [S, H, P, N] (its rows may be strided, as gathered from
    the pool) -> y [S, H, P] (no D term), state (h0 itself, updated, with `in_place`)."""
    seqs, heads, hd = x.shape
    groups = b.shape[1]
    decay = torch.exp(dt * a_coef)[..., None, None]
    state = h0.mul_(decay) if in_place else h0 * decay
    grouped = state.unflatten(1, (groups, heads // groups))  # [S, G, H/G, P, N], a view
    xdt = (x * dt[..., None]).unflatten(1, (groups, heads // groups))
    grouped.addcmul_(xdt[..., None], b[:, :, None, None, :])
    # y = state @ c per group as c^T @ state^T, [1, N] @ [N, H/G * P] per group: on CPU 2.5x
    # faster than a multiply-and-sum over N and 9x faster than [P, N] @ [N, 1] per head
    y = vec_times_rows(c, grouped.flatten(2, 3).transpose(-1, -2))
    return y.view(seqs, heads, hd), state


class GatedRMSNorm(nn.Module):
    """RMSNorm of y * silu(z), normalised over groups of `group` channels."""

    def __init__(self, dim: int, group: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.group = group
        self.eps = eps

    def forward(self, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        fused = cpu_kernels.gate_norm(y, z, self.weight, self.group, self.eps)  # one pass
        if fused is not None:
            return fused
        h = y.float() * F.silu(z.float())
        g = h.unflatten(-1, (-1, self.group))
        g = g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * g.flatten(-2).to(y.dtype)


class Mamba2Mixer(nn.Module):
    """Checkpoint names: in_proj, conv1d, dt_bias, A_log, D, norm.weight, out_proj."""

    def __init__(self, d: Mamba2Dims, name: str) -> None:
        super().__init__()
        self.name = name
        self.heads, self.head_dim = d.heads, d.head_dim
        self.groups, self.state = d.groups, d.state
        self.inner = d.inner
        self.chunk = d.chunk
        self.dt_limit = d.dt_limit
        self.conv_dim = d.conv_dim
        self.in_proj = nn.Linear(
            d.hidden, self.inner + self.conv_dim + self.heads, bias=d.proj_bias
        )
        self.conv1d = nn.Conv1d(
            self.conv_dim, self.conv_dim, d.conv_kernel, groups=self.conv_dim, bias=d.conv_bias
        )
        self.dt_bias = nn.Parameter(torch.ones(self.heads))
        self.A_log = nn.Parameter(torch.zeros(self.heads))
        self.D = nn.Parameter(torch.ones(self.heads))
        self.norm = GatedRMSNorm(self.inner, self.inner // self.groups, d.eps)
        self.out_proj = nn.Linear(self.inner, d.hidden, bias=d.proj_bias)
        self.act = activation(d.act)

    def forward(self, h: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        z, xbc, dt = self.project(h).split([self.inner, self.conv_dim, self.heads], dim=-1)
        dt = F.softplus((dt + self.dt_bias).float())
        dt = dt.clamp(min=self.dt_limit[0], max=self.dt_limit[1])
        a_coef = -torch.exp(self.A_log.float())
        rows, rest = split_state_seqs(self.name, batch)
        if rows is not None and not rest:  # every sequence adds one token, in row order
            y = self._step_rows(batch, rows, xbc, dt, a_coef)
        else:
            y = torch.empty(h.shape[0], self.inner, device=h.device, dtype=torch.float32)
            if rows is not None:
                t = rows.tokens
                y[t] = self._step_rows(batch, rows, xbc[t], dt[t], a_coef)
            for part in state_rounds(rest):  # a split sequence's second piece reads its first
                for seq in part:
                    if seq.num_new == 1:
                        sl = slice(seq.start, seq.end)
                        y[sl] = self._sequence(batch, seq, xbc[sl], dt[sl], a_coef)
                several = [seq for seq in part if seq.num_new > 1]
                if several:
                    self._prefill(batch, several, xbc, dt, a_coef, y)
        return self.out_proj(self.gate_and_norm(y, z).to(h.dtype))

    def project(self, h: torch.Tensor) -> torch.Tensor:
        """[T, hidden] -> the packed (z, xBC, dt) projection [T, inner + conv_dim + heads]."""
        return self.in_proj(h)

    def gate_and_norm(self, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """The SSM output y [T, inner] (float32) gated by z and normalised."""
        return self.norm(y, z)

    def _step_rows(self, batch, rows: StateRows, xbc, dt, a_coef) -> torch.Tensor:
        """One token for each of S sequences (xbc [S, C], dt [S, H]): conv and SSD steps on
        the pool's state rows where they lie (C kernels), else on stacked states, gathered
        from and scattered back to the pool once."""
        y = self._step_in_place(batch, rows, xbc, dt, a_coef)
        if y is not None:
            return y
        conv_state, ssm_state = read_state_rows(self.name, batch, rows)
        x, b, c = self._split_heads(self._conv_step(conv_state, xbc))
        # the gathered states are copies: update them where they are, and hand them back
        # (a pool whose states span several blocks then writes their buffer back as is)
        # (not float32: float() converts them into a new tensor, also updated in place)
        h1 = ssm_state.float()
        y = cpu_kernels.ssd_step(x, dt, a_coef, b, c, h1)  # one pass over the states
        if y is None:
            y, h1 = _ssd_step(x, dt, a_coef, b, c, h1, in_place=True)
        y = y + x * self.D.float()[:, None]
        write_state_rows(self.name, batch, rows, [conv_state, h1])
        return y.flatten(1)

    def _step_in_place(self, batch, rows: StateRows, xbc, dt, a_coef) -> torch.Tensor | None:
        """`_step_rows` by the C kernels on each row's state in its pool page (the same
        arithmetic as on stacked rows); None, the states untouched, where they do not apply."""
        paged = state_rows_in_place(self.name, batch, rows) if self.act is F.silu else None
        if paged is None:
            return None
        (conv_view, ssm_view), ids = paged  # float32 (state_rows_in_place)
        weight = self.conv1d.weight[:, 0]
        out = cpu_kernels.conv_step_silu(conv_view, xbc, weight, self.conv1d.bias, ids)
        if out is None:
            return None
        x, b, c = self._split_heads(out)
        y = cpu_kernels.ssd_step(x, dt, a_coef, b, c, ssm_view, ids)
        if y is None:  # the conv states took the token: the SSD step on copies of the rows
            y, h1 = _ssd_step(x, dt, a_coef, b, c, ssm_view.index_select(0, ids), in_place=True)
            ssm_view.index_copy_(0, ids, h1)
        return (y + x * self.D.float()[:, None]).flatten(1)

    def _conv_step(self, conv_state: torch.Tensor, xbc: torch.Tensor) -> torch.Tensor:
        """One new input per sequence (xbc [S, C]) through the causal conv and the
        activation -> [S, C]; conv_state [S, C, K-1] takes the input (in place). SiLU on the
        CPU in float32: `conv_step_silu`, a prompt's arithmetic (`conv_silu`) per token."""
        weight = self.conv1d.weight[:, 0]  # [C, K]
        if self.act is F.silu:
            out = cpu_kernels.conv_step_silu(conv_state, xbc, weight, self.conv1d.bias)
            if out is not None:
                return out
        window = torch.cat([conv_state.to(xbc.dtype), xbc[:, :, None]], dim=2)  # [S, C, K]
        conv = (window * weight).sum(-1)
        if self.conv1d.bias is not None:
            conv = conv + self.conv1d.bias
        # converted whole, then sliced: a converting copy from the strided slice is 4x slower
        conv_state.copy_(window.to(conv_state.dtype)[:, :, 1:])
        return self.act(conv)

    def _split_heads(self, xbc: torch.Tensor):
        """Activated conv output [L, C] -> x [L, H, P], b and c [L, G, N] (float32)."""
        length = xbc.shape[0]
        gn = self.groups * self.state
        x, b, c = xbc.float().split([self.inner, gn, gn], dim=-1)
        b = b.view(length, self.groups, self.state)
        c = c.view(length, self.groups, self.state)
        return x.view(length, self.heads, self.head_dim), b, c

    def _sequence(self, batch, seq: SeqInfo, xbc, dt, a_coef) -> torch.Tensor:
        """One new token of one sequence: the recurrence on its own state."""
        conv_state, ssm_state = read_state(self.name, batch, seq)
        own = conv_state.clone(memory_format=torch.contiguous_format)[None]  # maybe the pool's
        x, b, c = self._split_heads(self._conv_step(own, xbc))
        h1 = ssm_state.float()[None].clone()  # `ssm_state` may be the pool's
        y = cpu_kernels.ssd_step(x, dt, a_coef, b, c, h1)  # a rows step's arithmetic
        if y is None:
            y, h1 = _ssd_step(x, dt, a_coef, b, c, h1, in_place=True)
        y = y + x * self.D.float()[:, None]
        write_state(self.name, batch, seq, [own[0], h1[0].to(ssm_state.dtype)])
        return y.reshape(1, self.inner)

    def _prefill(self, batch, seqs: list[SeqInfo], xbc, dt, a_coef, y: torch.Tensor) -> None:
        """Sequences adding several tokens each, all together: one causal conv over their
        windows side by side and one chunked scan over their chunks; writes their rows of y."""
        states = [read_state(self.name, batch, seq) for seq in seqs]
        k1 = self.conv1d.weight.shape[-1] - 1
        dev = xbc.device
        # [K-1 previous inputs | new inputs] of each sequence, one after another: [sum(K-1+L), C]
        # in float32 (exact for the inputs, and the conv sums in float32 whatever their dtype)
        parts, ends = [], []
        for seq, (conv_state, _) in zip(seqs, states, strict=True):
            parts += [conv_state.t(), xbc[seq.start : seq.end]]
            ends.append((ends[-1] if ends else 0) + k1 + seq.num_new)
        window = torch.cat(parts).float()
        lengths = [seq.num_new for seq in seqs]
        lens = torch.tensor(lengths, device=dev)
        firsts = torch.tensor(ends, device=dev) - k1 - lens
        total = sum(lengths)
        # output t's first tap: the window row where its K taps start (a sequence's outputs
        # start at its window's first row)
        picks = torch.arange(total, device=dev) + (
            firsts - (lens.cumsum(0) - lens)
        ).repeat_interleave(lens, output_size=total)
        weight = self.conv1d.weight[:, 0].float().t()  # [K, C]
        bias = None if self.conv1d.bias is None else self.conv1d.bias.float()
        act = None
        if self.act is F.silu:
            act = cpu_kernels.conv_silu(window, weight.contiguous(), bias, picks)
        if act is None:
            # the depthwise causal conv as K shifted multiply-adds on token-major rows:
            # output row j covers window rows j .. j+K-1; the K-1 rows spanning two
            # windows are dropped
            span = window.shape[0] - k1
            if bias is not None:
                conv = torch.addcmul(bias, window[:span], weight[0])
            else:
                conv = window[:span] * weight[0]
            for k in range(1, k1 + 1):
                conv.addcmul_(window[k : k + span], weight[k])
            act = self.act(conv.index_select(0, picks))  # [T', C]
        gn = self.groups * self.state
        x, b, c = act.split([self.inner, gn, gn], dim=-1)
        x = x.view(total, self.heads, self.head_dim)
        b = b.view(total, self.groups, self.state)
        c = c.view(total, self.groups, self.state)
        contiguous = all(a.end == z.start for a, z in itertools.pairwise(seqs))
        if contiguous:
            rows = slice(seqs[0].start, seqs[-1].end)
        else:
            rows = torch.cat([torch.arange(seq.start, seq.end, device=dev) for seq in seqs])
        chunk = min(self.chunk, SCAN_CHUNK)
        offsets = [seq.num_computed % chunk for seq in seqs]
        h0 = torch.stack([ssm.float() for _, ssm in states])
        out = cpu_kernels.ssd_scan(x, dt[rows], a_coef, b, c, h0, lengths)  # h0 -> h1
        if out is not None:
            h1 = h0
        else:
            out, h1 = _ssd_packed(x, dt[rows], a_coef, b, c, chunk, h0, offsets, lengths)
        out.addcmul_(x, self.D.float()[:, None])
        y[rows] = out.reshape(total, self.inner)
        for i, (seq, (conv_state, ssm_state)) in enumerate(zip(seqs, states, strict=True)):
            new_conv = window[ends[i] - k1 : ends[i]].t().to(conv_state.dtype)
            write_state(self.name, batch, seq, [new_conv, h1[i].to(ssm_state.dtype)])


def check_state_spec(d: Mamba2Dims, spec: object, layer: str, arch: str) -> None:
    """Raise ValueError unless `spec` (the layer's cache spec) is the state page of `d`."""
    want = ((d.conv_dim, d.conv_kernel - 1), (d.heads, d.head_dim, d.state))
    shapes = getattr(spec, "shapes", None)
    if shapes is None or tuple(tuple(s) for s in shapes) != want:
        raise ValueError(
            f"{arch}: {layer} is a Mamba2 layer of state shapes {want}, but its cache spec "
            f"is {spec!r}"
        )
