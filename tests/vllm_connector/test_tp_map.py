"""The mapping between vLLM servers of different tensor-parallel sizes, byte for byte.

Synthetic caches laid out as vLLM's CPU build lays them out (per layer, block first; a
state layer's conv and SSM tensors views into one padded page per block), sharded as
vLLM shards the weights that write them (heads, groups replicated below TP, x / B / C
channels per conv tap). Each decode rank reads its pieces from the prefill ranks its
plan names (a real memmove per piece, as a one-sided read moves them); its caches must
then equal the shards vLLM would hold at the decode size, the blocks no piece names must
stay untouched, and each rank must read exactly its own shard's bytes.
"""

from __future__ import annotations

import ctypes
from types import SimpleNamespace

import pytest
import torch

from hybrid_pd.connector.layout import GroupGeometry, KVLayout
from hybrid_pd.connector.vllm.plan import VllmPlan
from hybrid_pd.connector.vllm.rank_plan import RankPlan, check_views, readers, sources
from hybrid_pd.connector.vllm.tp_rows import attention_rows, state_rows
from hybrid_pd.kvcache.specs import (
    FullAttentionSpec,
    gdn_state_spec,
    mamba1_state_spec,
    mamba2_state_spec,
)
from hybrid_pd.kvcache.tp_layout import TPLayoutError

NUM_BLOCKS = 9
BLOCK = 4
TAPS = 3  # conv kernel - 1
LAYERS = 2
#: Kept blocks on prefill and where decode wants them (decode holds the first block: the
#: pairs run from the end, as VllmPlan pairs them).
SRC_BLOCKS = [2, 3, 7, 8]
DST_BLOCKS = [1, 6, 5]


def _split(n: int, size: int, rank: int) -> slice:
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
        return [full[0][:, _split(self.heads, size, rank)].contiguous()]

    def rows(self, size: int):
        rank = self.shard(self.full(), size, 0)[0]
        heads = rank.shape[1]
        return attention_rows(self.full_spec, heads, rank[0, 0].numel() * _es(self.dtype), size)


class State:
    """A state layer: conv [blocks, taps, channels] ("SD") whose channels are segments
    split separately (x | B | C, or q | k | v), and a head-major state [blocks, heads, ...].
    Both live in one page per block, padded, as vLLM's views over its raw buffer."""

    def __init__(self, full_spec, conv_parts, heads: int, inner, conv_dtype, ssm_dtype):
        self.full_spec = full_spec
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
            parts.append(seg[..., _split(units, size, rank), :].flatten(-2))
            at += units * width
        return [torch.cat(parts, -1).contiguous(), ssm[:, _split(self.heads, size, rank)]]

    def rows(self, size: int):
        conv, ssm = self.shard(self.full(), size, 0)
        shapes = [conv.shape[1:], ssm.shape[1:]]
        return state_rows(self.full_spec, shapes, [_es(self.conv_dtype), _es(self.ssm_dtype)], size)


def _es(dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def mamba2(n_groups: int) -> State:
    heads, head_dim, n = 4, 4, 6
    spec = mamba2_state_spec(
        num_heads=heads, head_dim=head_dim, state_size=n, n_groups=n_groups, conv_kernel=TAPS + 1
    )
    parts = [(heads, head_dim, False), (n_groups, n, True), (n_groups, n, True)]
    return State(spec, parts, heads, (head_dim, n), torch.bfloat16, torch.float32)


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


def _rank_caches(kinds, fulls, size: int, rank: int, fill: float | None = None):
    """A rank's vLLM-like caches: group g's layers' tensors as views over one raw buffer
    of padded pages (state: conv then SSM in a page), filled with its shard of `fulls`
    (or a constant). Returns (kv_caches, kv_cache_config, layout)."""
    caches, groups, geos = {}, [], []
    for g, kind in enumerate(kinds):
        names = []
        shards = [kind.shard(fulls[g][layer], size, rank) for layer in range(LAYERS)]
        sizes = [t[0].numel() * t.element_size() for t in shards[0]]
        page = sum(sizes) + (64 if len(sizes) > 1 else 0)  # vLLM pads state pages
        for layer in range(LAYERS):
            raw = torch.zeros(NUM_BLOCKS, page, dtype=torch.uint8)
            views, at = [], 0
            for t in shards[layer]:
                es = t.element_size()
                shape = (NUM_BLOCKS, *t.shape[1:])
                stride = (page // es, *torch.empty(t.shape[1:]).stride())
                v = torch.as_strided(raw.view(-1).view(t.dtype), shape, stride, at // es)
                v.copy_(t if fill is None else torch.full_like(t, fill))
                views.append(v)
                at += t[0].numel() * es
            name = f"model.layers.{g * LAYERS + layer}.mixer"
            caches[name] = views if len(views) > 1 else views[0]
            names.append(name)
        groups.append(SimpleNamespace(layer_names=names))
        geos.append(GroupGeometry("k", "s", LAYERS, page, 1, kind.rows(size)))
    config = SimpleNamespace(transfer_groups=groups, num_blocks=NUM_BLOCKS)
    layout = KVLayout(BLOCK, geos[0].slot_bytes, tuple(geos), "vllm:tiny:X", size)
    return caches, config, layout


def _read(dst_plan: VllmPlan, src_plans: list[VllmPlan], src_layout, dst_layout, d: int):
    """Decode rank d reads its pieces from each source rank; returns bytes per source."""
    got = {}
    for p in sources([g.rows for g in dst_layout.groups], src_layout.tp_size,
                     dst_layout.tp_size, d):  # fmt: skip
        plan = RankPlan(src_layout, dst_layout, p, d, dst_plan.views)
        runs = plan.runs([SRC_BLOCKS] * len(dst_plan.views), [DST_BLOCKS] * len(dst_plan.views))
        pieces, local, _ = plan.read_pieces(runs)
        regions = src_plans[p].memory()
        for (k, off, n), to in zip(pieces.tolist(), local.tolist(), strict=True):
            assert 0 <= off and off + n <= regions[k][1]
            ctypes.memmove(to, regions[k][0] + off, n)
        # the prefill rank counts the same bytes with its own plan (no cache needed)
        counted = RankPlan(src_layout, dst_layout, p, d).nbytes(
            RankPlan(src_layout, dst_layout, p, d).runs(
                [SRC_BLOCKS] * len(dst_plan.views), [DST_BLOCKS] * len(dst_plan.views)
            )
        )
        assert counted == plan.nbytes(runs)
        got[p] = plan.nbytes(runs)
    return got


CASES = {
    "attention_kv2": [Attention(2)],
    "attention_kv1_replicated": [Attention(1)],
    "mamba2_groups1": [mamba2(1)],
    "mamba2_groups2": [mamba2(2)],
    "gdn": [gdn()],
    "mamba1": [mamba1()],
    "granite_like": [Attention(1), mamba2(1)],
}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize(("src_size", "dst_size"), [(1, 2), (2, 1), (2, 2), (1, 4), (4, 2)])
def test_decode_ranks_hold_their_shards_after_reading(case, src_size, dst_size):
    kinds = CASES[case]
    for kind in kinds:
        try:
            kind.rows(max(src_size, dst_size))
        except TPLayoutError:
            pytest.skip(f"{case} does not split over {max(src_size, dst_size)} ranks")
    torch.manual_seed(0)
    fulls = [[k.full() for _ in range(LAYERS)] for k in kinds]
    src = [_rank_caches(kinds, fulls, src_size, p) for p in range(src_size)]
    src_plans = [VllmPlan(cfg, caches) for caches, cfg, _ in src]
    src_layout = src[0][2]
    for plan, (_, _, layout) in zip(src_plans, src, strict=True):
        check_views(plan.views, layout)
    for d in range(dst_size):
        caches, cfg, dst_layout = _rank_caches(kinds, fulls, dst_size, d, fill=-7.0)
        assert src_layout.difference(dst_layout) is None
        dst_plan = VllmPlan(cfg, caches)
        check_views(dst_plan.views, dst_layout)
        by_src = _read(dst_plan, src_plans, src_layout, dst_layout, d)
        if src_size <= dst_size:  # one prefill rank holds all its rows
            assert list(by_src) == [d * src_size // dst_size]
        want_bytes = 0
        for g, kind in enumerate(kinds):
            for layer in range(LAYERS):
                name = f"model.layers.{g * LAYERS + layer}.mixer"
                got = caches[name] if isinstance(caches[name], list) else [caches[name]]
                want = kind.shard(fulls[g][layer], dst_size, d)
                for t_got, t_want in zip(got, want, strict=True):
                    for s, b in zip(SRC_BLOCKS[1:], DST_BLOCKS, strict=True):
                        assert torch.equal(t_got[b], t_want[s]), (name, s, b)
                    others = [b for b in range(NUM_BLOCKS) if b not in DST_BLOCKS]
                    assert (t_got[others] == -7.0).all(), "a block no piece names was written"
                    want_bytes += len(DST_BLOCKS) * t_want[0].numel() * t_want.element_size()
        assert sum(by_src.values()) == want_bytes  # its own shard, once: the minimum


def test_readers_count_the_decode_ranks_reading_a_prefill_rank():
    rows = [g.rows for g in _rank_caches([Attention(1), mamba2(1)], [[Attention(1).full()] * 2,
            [mamba2(1).full()] * 2], 2, 0)[2].groups]  # fmt: skip
    assert readers(rows, 1, 2, 0) == 2  # TP 1 -> 2: both decode ranks read rank 0
    assert [readers(rows, 2, 1, p) for p in (0, 1)] == [1, 1]
    assert sources(rows, 2, 1, 0) == [0, 1]
    assert [sources(rows, 1, 2, d) for d in (0, 1)] == [[0], [0]]


def test_attention_with_k_and_v_apart_is_not_taken_for_head_major():
    """A K/V-split cache (vLLM's GPU backends: [2, blocks, block, heads, dim]) has the
    same bytes per block but not one row per head: the check refuses it by name."""
    kind = Attention(2)
    _, cfg, layout = _rank_caches([kind], [[kind.full()] * LAYERS], 1, 0)
    split = {n: torch.zeros(2, NUM_BLOCKS, BLOCK, 2, 8) for n in cfg.transfer_groups[0].layer_names}
    with pytest.raises(TPLayoutError, match="group 0: 4 cache tensors, rows for 1"):
        check_views(VllmPlan(cfg, split).views, layout)


def test_shapes_vllm_does_not_split_so_are_not_described():
    kind = mamba2(1)
    with pytest.raises(TPLayoutError, match="conv channels per rank"):
        state_rows(kind.full_spec, [(TAPS, 16 + 2 * 6 * 2), (2, 4, 6)], [2, 4], 2)
    with pytest.raises(TPLayoutError, match="KV heads per rank"):
        attention_rows(Attention(2).full_spec, 2, 256, 2)


def test_handshake_accepts_described_pairs_and_names_what_differs():
    kinds = [Attention(1), mamba2(1)]
    fulls = [[k.full() for _ in range(LAYERS)] for k in kinds]
    one, two = (_rank_caches(kinds, fulls, n, 0)[2] for n in (1, 2))
    assert one.difference(two) is None and two.difference(one) is None
    kinds = [Attention(1), mamba2(2)]
    fulls = [[k.full() for _ in range(LAYERS)] for k in kinds]
    other = _rank_caches(kinds, fulls, 2, 0)[2]
    assert "group 1" in one.difference(other)
    bare = KVLayout(two.block_size, two.page_size_bytes,
                    tuple(GroupGeometry("k", "s", LAYERS, g.slot_bytes, 1) for g in two.groups),
                    two.model, 2)  # fmt: skip
    assert "does not describe its slot rows" in one.difference(bare)
