"""Synthetic caches laid out as vLLM's CPU build lays them out, per tensor-parallel rank
(per layer, block first; a state layer's conv and SSM tensors views into one padded page
per block), sharded as vLLM shards the weights that write them: KV heads (replicated
below TP), Mamba2 x by head and B / C by group (replicated below TP), GDN q / k by key
head and v by value head, Mamba1 by inner channel; conv channels per tap ("SD")."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from hybrid_pd.connector.layout import GroupGeometry, KVLayout
from hybrid_pd.connector.vllm.tp_rows import attention_rows, state_rows
from hybrid_pd.kvcache.specs import (
    FullAttentionSpec,
    gdn_state_spec,
    mamba1_state_spec,
    mamba2_state_spec,
)

NUM_BLOCKS = 9
BLOCK = 4
TAPS = 3  # conv kernel - 1
LAYERS = 2
#: Kept blocks on prefill and where decode wants them (decode holds the first block: the
#: pairs run from the end, as VllmPlan pairs them).
SRC_BLOCKS = [2, 3, 7, 8]
DST_BLOCKS = [1, 6, 5]


def split(n: int, size: int, rank: int) -> slice:
    """The units rank `rank` of `size` holds, vLLM's way: an even share, or (fewer units
    than ranks) the one unit rank // (size / n) (replicated KV heads, Mamba2 groups)."""
    if n % size == 0:
        per = n // size
        return slice(rank * per, (rank + 1) * per)
    assert size % n == 0
    u = rank // (size // n)
    return slice(u, u + 1)


class Attention:
    """[blocks, kv_heads, block, K | V]: a rank holds its heads."""

    def __init__(self, heads: int, head_dim: int = 8, dtype=torch.float32) -> None:
        self.heads, self.head_dim, self.dtype = heads, head_dim, dtype
        self.full_spec = FullAttentionSpec(
            num_kv_heads=heads, head_dim=head_dim, dtype=str(dtype).split(".")[1]
        )

    def full(self) -> list[torch.Tensor]:
        return [torch.randn(NUM_BLOCKS, self.heads, BLOCK, 2 * self.head_dim, dtype=self.dtype)]

    def shard(self, full: list[torch.Tensor], size: int, rank: int) -> list[torch.Tensor]:
        return [full[0][:, split(self.heads, size, rank)].contiguous()]

    def rows(self, size: int):
        rank = self.shard(self.full(), size, 0)[0]
        heads = rank.shape[1]
        return attention_rows(self.full_spec, heads, rank[0, 0].numel() * es(self.dtype), size)


class State:
    """A state layer: conv [blocks, taps, channels] ("SD") whose channels are segments
    split separately (x | B | C, or q | k | v), and a head-major state [blocks, heads, ...].
    Both live in one page per block, padded, as vLLM's views over its raw buffer. `ds`:
    the conv state dim-first, [blocks, channels, taps] (VLLM_SSM_CONV_STATE_LAYOUT=DS)."""

    def __init__(self, full_spec, conv_parts, heads: int, inner, conv_dtype, ssm_dtype, ds=False):
        self.full_spec, self.ds = full_spec, ds
        self.conv_parts = conv_parts  # [(units, width, replicated)], TP 1
        self.heads, self.inner = heads, inner
        self.conv_dtype, self.ssm_dtype = conv_dtype, ssm_dtype

    def full(self) -> list[torch.Tensor]:
        width = sum(u * w for u, w, _ in self.conv_parts)
        conv = torch.randn(NUM_BLOCKS, TAPS, width).to(self.conv_dtype)
        ssm = torch.randn(NUM_BLOCKS, self.heads, *self.inner).to(self.ssm_dtype)
        return [conv, ssm]

    def shard(self, full: list[torch.Tensor], size: int, rank: int) -> list[torch.Tensor]:
        conv, ssm = full
        parts, at = [], 0
        for units, width, _ in self.conv_parts:
            seg = conv[..., at : at + units * width].unflatten(-1, (units, width))
            parts.append(seg[..., split(units, size, rank), :].flatten(-2))
            at += units * width
        conv = torch.cat(parts, -1)
        conv = conv.transpose(1, 2) if self.ds else conv
        return [conv.contiguous(), ssm[:, split(self.heads, size, rank)]]

    def rows(self, size: int):
        conv, ssm = self.shard(self.full(), size, 0)
        shapes = [conv.shape[1:], ssm.shape[1:]]
        sizes = [es(self.conv_dtype), es(self.ssm_dtype)]
        return state_rows(self.full_spec, shapes, sizes, size, conv_dim_first=self.ds)


def es(dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def mamba2(n_groups: int, ds: bool = False) -> State:
    heads, head_dim, n = 4, 4, 6
    spec = mamba2_state_spec(
        num_heads=heads, head_dim=head_dim, state_size=n, n_groups=n_groups, conv_kernel=TAPS + 1
    )
    parts = [(heads, head_dim, False), (n_groups, n, True), (n_groups, n, True)]
    return State(spec, parts, heads, (head_dim, n), torch.bfloat16, torch.float32, ds)


def gdn() -> State:
    nk, nv, dk, dv = 2, 4, 4, 3
    spec = gdn_state_spec(
        num_k_heads=nk, num_v_heads=nv, head_k_dim=dk, head_v_dim=dv, conv_kernel=TAPS + 1
    )
    parts = [(nk, dk, False), (nk, dk, False), (nv, dv, False)]
    return State(spec, parts, nv, (dv, dk), torch.float32, torch.float32)


def mamba1() -> State:
    inner, n = 8, 5
    spec = mamba1_state_spec(intermediate_size=inner, state_size=n, conv_kernel=TAPS + 1)
    return State(spec, [(inner, 1, False)], inner, (n,), torch.float32, torch.float32)


def rank_caches(kinds, fulls, size: int, rank: int, fill: float | None = None):
    """A rank's vLLM-like caches, filled with its shard of `fulls` (or a constant): per
    layer one view over its own buffer of pages, indexed by block first, as vLLM gives
    them to `register_kv_caches`: attention [blocks, heads, block, K | V]; a state layer
    [blocks, 1, 1, bytes] of int8 whose block holds its conv and SSM states packed, the
    page padded beyond them. Returns (kv_caches, kv_cache_config, layout, tensors):
    `tensors[name]`, each layer's typed tensors (views into the same memory)."""
    caches, tensors, groups, geos = {}, {}, [], []
    for g, kind in enumerate(kinds):
        names = []
        shards = [kind.shard(fulls[g][layer], size, rank) for layer in range(LAYERS)]
        sizes = [t[0].numel() * t.element_size() for t in shards[0]]
        content = sum(sizes)
        page = content + (64 if len(sizes) > 1 else 0)  # vLLM pads state pages
        for layer in range(LAYERS):
            raw = torch.zeros(NUM_BLOCKS * page, dtype=torch.uint8)
            views, at = [], 0
            for t in shards[layer]:
                es = t.element_size()
                shape = (NUM_BLOCKS, *t.shape[1:])
                stride = (page // es, *torch.empty(t.shape[1:]).stride())
                v = torch.as_strided(raw.view(t.dtype), shape, stride, at // es)
                v.copy_(t if fill is None else torch.full_like(t, fill))
                views.append(v)
                at += t[0].numel() * es
            name = f"model.layers.{g * LAYERS + layer}.mixer"
            tensors[name] = views
            if len(views) == 1:
                caches[name] = views[0]
            else:
                pages = torch.as_strided(raw.view(torch.int8), (NUM_BLOCKS, 1, 1, content),
                                         (page, content, content, 1))  # fmt: skip
                caches[name] = pages
            names.append(name)
        groups.append(SimpleNamespace(layer_names=names))
        geos.append(GroupGeometry("k", "s", LAYERS, page, 1, kind.rows(size)))
    config = SimpleNamespace(transfer_groups=groups, num_blocks=NUM_BLOCKS)
    layout = KVLayout(BLOCK, geos[0].slot_bytes, tuple(geos), "vllm:tiny:X", size)
    return caches, config, layout, tensors
