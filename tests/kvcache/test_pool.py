"""KVPool: typed per-layer views into one byte buffer, sharded states, page copies."""

from __future__ import annotations

import inspect
from itertools import pairwise

import pytest
import torch

from hybrid_pd.kvcache import pool as pool_module
from hybrid_pd.kvcache.block_pool import BlockPool
from hybrid_pd.kvcache.config import KVCacheConfig, KVCacheGroup, slot_bytes_for
from hybrid_pd.kvcache.ids import BlockId
from hybrid_pd.kvcache.pool import KVPool, num_blocks_for_memory
from hybrid_pd.kvcache.specs import FullAttentionSpec, SlidingWindowSpec, StateSpec

B = 4
FA = FullAttentionSpec(2, 4, "fp16")  # 2 * 2 * 4 * 2 = 32 bytes per token, 128 per block
SW = SlidingWindowSpec(1, 8, "fp32", window=8)  # 2 * 1 * 8 * 4 = 64 per token, 256 per block
SMALL = StateSpec(((3, 5), (2, 3)), ("fp16", "fp32"))  # 30 B at 0, 24 B at 32: 64 aligned
BIG = StateSpec(((4, 6), (5, 7)), ("bf16", "fp32"))  # 48 B at 0, 140 B at 48: 192 aligned
PAGE = 512


def config() -> KVCacheConfig:
    groups = (
        KVCacheGroup(0, FA, ("a0", "a1"), slot_bytes_for(FA, B)),  # 2 x 128
        KVCacheGroup(1, SW, ("w0",), slot_bytes_for(SW, B)),  # 256
        KVCacheGroup(2, SMALL, ("m0", "m1"), slot_bytes_for(SMALL, B)),  # 2 x 64
        KVCacheGroup(3, BIG, ("g0",), slot_bytes_for(BIG, B, 3), 3),  # 64 per block, 3 blocks
    )
    return KVCacheConfig(B, PAGE, groups, shared_layers={"a2": "a1"})


@pytest.fixture(params=[str(torch.device("cpu"))])  # the only place a device is named
def pool(request: pytest.FixtureRequest) -> KVPool:
    return KVPool(config(), num_blocks=8, device=request.param)


def layer_range(pool: KVPool, view: torch.Tensor) -> tuple[int, int]:
    """Byte range of one block's part of a per-layer view, relative to its page."""
    start = view[0].data_ptr() - pool.buffer.data_ptr()
    return start, start + view[0].numel() * view.element_size()


def test_buffer_and_device(pool: KVPool, request: pytest.FixtureRequest) -> None:
    device = torch.device(request.node.callspec.params["pool"])
    assert pool.buffer.shape == (8, PAGE) and pool.buffer.dtype == torch.uint8
    assert pool.device == device and int(pool.buffer.count_nonzero()) == 0
    assert pool.attention_view("a0").device == device
    assert pool.read_state("g0", [1, 2, 3])[0].device == device
    pool.copy_blocks([(1, 2)])
    source = inspect.getsource(pool_module)  # the device always comes from the caller
    assert '"cpu"' not in source and "'cpu'" not in source


def test_attention_view_shape_dtype_and_strides(pool: KVPool) -> None:
    view = pool.attention_view("a1")
    assert view.shape == (8, 2, B, 2, 4) and view.dtype == torch.float16
    # head-major slot [kv_heads, 2, B, head_dim]: a head's K and V side by side
    assert view.stride() == (PAGE // 2, B * 4, 4, 2 * B * 4, 1)
    assert layer_range(pool, view) == (128, 256)
    sw = pool.attention_view("w0")
    assert sw.shape == (8, 2, B, 1, 8) and sw.dtype == torch.float32
    assert sw.stride() == (PAGE // 4, B * 8, 8, 2 * B * 8, 1)
    assert layer_range(pool, sw) == (0, 256)  # first slot of its own group's page


def test_writing_one_layers_block_only_touches_its_slot(pool: KVPool) -> None:
    view = pool.attention_view("a1")
    view[5] = torch.arange(view[5].numel(), dtype=torch.float16).view(view[5].shape) + 1
    changed = pool.buffer.nonzero().tolist()
    assert changed and all(r == 5 and 128 <= c < 256 for r, c in changed)
    # K then V, each [B, H, D]: V of token 0, head 1 starts after B*H*D K values.
    assert view[5, 1, 0, 1, 0].item() == B * 2 * 4 + 4 + 1
    assert torch.equal(pool.attention_view("a2"), view)  # KV-sharing layer reads a1's KV
    assert pool.attention_view("a0").count_nonzero() == 0


def test_views_of_different_layers_do_not_overlap(pool: KVPool) -> None:
    views = {
        "a0": pool.attention_view("a0"),
        "a1": pool.attention_view("a1"),
        "w0": pool.attention_view("w0"),
        "m0": pool.state_views("m0")[0],
        "m0.ssm": pool.state_views("m0")[1],
        "m1": pool.state_views("m1")[0],
        "m1.ssm": pool.state_views("m1")[1],
    }
    # Layers of one group share pages, so their byte ranges within a page must be disjoint.
    for members in (("a0", "a1"), ("m0", "m0.ssm", "m1", "m1.ssm")):
        ranges = sorted(layer_range(pool, views[n]) for n in members)
        assert all(a[1] <= b[0] for a, b in pairwise(ranges))
        assert ranges[-1][1] <= PAGE
    # A block belongs to one group at a time: give each group its own block and fill every
    # layer's part with its own value; each must read back intact.
    block = {"a0": 1, "a1": 1, "w0": 2, "m0": 3, "m0.ssm": 3, "m1": 3, "m1.ssm": 3}
    for value, name in enumerate(views, start=1):
        views[name][block[name]].fill_(value)
    pool.write_state("g0", [4, 6, 5], [torch.full((4, 6), 9.0), torch.full((5, 7), 10.0)])
    for value, name in enumerate(views, start=1):
        assert bool((views[name][block[name]] == value).all()), name
    assert [float(t.unique()) for t in pool.read_state("g0", [4, 6, 5])] == [9.0, 10.0]
    assert not pool.buffer[[0, 7]].count_nonzero()


def test_state_views_for_in_place_states(pool: KVPool) -> None:
    conv, ssm = pool.state_views("m1")
    assert conv.shape == (8, 3, 5) and conv.dtype == torch.float16
    assert ssm.shape == (8, 2, 3) and ssm.dtype == torch.float32
    assert layer_range(pool, conv) == (64, 64 + 30)  # second slot of its group's page
    assert layer_range(pool, ssm) == (64 + 32, 64 + 56)  # aligned to 16
    conv[3] = torch.full((3, 5), 2.5, dtype=torch.float16)
    ssm[3] = torch.arange(6, dtype=torch.float32).view(2, 3)
    rows = {r for r, _ in pool.buffer.nonzero().tolist()}
    assert rows == {3}
    got = pool.read_state("m1", [3])
    assert torch.equal(got[0], conv[3]) and torch.equal(got[1], ssm[3])
    with pytest.raises(ValueError, match="spans 3 blocks"):
        pool.state_views("g0")


def test_sharded_state_round_trip_over_non_consecutive_blocks(pool: KVPool) -> None:
    gen = torch.Generator().manual_seed(0)
    conv = torch.randn(4, 6, generator=gen).to(torch.bfloat16)
    ssm = torch.randn(5, 7, generator=gen)
    ids = [6, 2, 4]
    pool.write_state("g0", ids, [conv, ssm])
    got = pool.read_state("g0", ids)
    assert got[0].dtype == torch.bfloat16 and got[0].shape == (4, 6)
    assert torch.equal(got[0], conv) and torch.equal(got[1], ssm)
    # g0 is the only layer of its group: its 64-byte slot starts each of its pages.
    rows = {r for r, c in pool.buffer.nonzero().tolist() if c < 64}
    assert rows <= set(ids) and not pool.buffer[:, 64:].count_nonzero()
    flat = torch.cat([pool.buffer[b, :64] for b in ids])  # shard j lives in the j-th block
    assert torch.equal(flat[:48], conv.view(torch.uint8).reshape(-1))
    assert torch.equal(flat[48 : 48 + 140], ssm.view(torch.uint8).reshape(-1))
    assert not torch.equal(pool.read_state("g0", [2, 6, 4])[0], conv)  # order matters
    with pytest.raises(ValueError, match="needs 3 state blocks"):
        pool.read_state("g0", [6, 2])


def test_write_state_casts_and_leaves_neighbours_alone(pool: KVPool) -> None:
    pool.state_views("m0")[0][1].fill_(7)  # neighbour layer in the same page
    pool.write_state("m1", [1], [torch.ones(3, 5), torch.full((2, 3), 3.0)])
    conv, ssm = pool.read_state("m1", [1])
    assert conv.dtype == torch.float16 and bool((conv == 1).all())
    assert bool((ssm == 3).all())
    assert bool((pool.state_views("m0")[0][1] == 7).all())
    assert pool.state_views("m0")[1][1].count_nonzero() == 0
    before = pool.buffer.clone()
    with pytest.raises(ValueError, match="expected"):  # 20 values would overrun into ssm
        pool.write_state("m1", [1], [torch.ones(4, 5), torch.ones(2, 3)])
    with pytest.raises(ValueError, match="needs 3 state blocks"):
        pool.write_state("g0", [1, 2], [torch.ones(4, 6), torch.ones(5, 7)])
    with pytest.raises(ValueError):
        pool.write_state("m1", [1], [torch.ones(3, 5)])  # one tensor short
    assert torch.equal(pool.buffer, before)
    pool.write_state("m1", [2], [torch.ones(15), torch.ones(6)])  # flat is fine
    assert pool.read_state("m1", [2])[0].shape == (3, 5)


def test_copy_blocks_copies_whole_pages(pool: KVPool) -> None:
    gen = torch.Generator().manual_seed(1)
    pool.buffer.copy_(torch.randint(0, 256, pool.buffer.shape, generator=gen, dtype=torch.uint8))
    before = pool.buffer.clone()
    pool.copy_blocks([(1, 4), (3, 6)])
    assert torch.equal(pool.buffer[4], before[1]) and torch.equal(pool.buffer[6], before[3])
    untouched = [0, 1, 2, 3, 5, 7]
    assert torch.equal(pool.buffer[untouched], before[untouched])
    pool.copy_blocks([])
    copied, source = pool.read_state("g0", [4, 5, 6])[1], pool.read_state("g0", [1, 5, 3])[1]
    assert torch.equal(copied.view(torch.uint8), source.view(torch.uint8))  # random bits: NaNs


def test_region_and_type_errors(pool: KVPool) -> None:
    region = pool.region(2, 3)
    assert region.shape == (3, PAGE) and region.data_ptr() == pool.buffer[2].data_ptr()
    assert region.is_contiguous()
    with pytest.raises(TypeError, match="not an attention layer"):
        pool.attention_view("m0")
    with pytest.raises(TypeError, match="not a state layer"):
        pool.state_views("a0")
    with pytest.raises(KeyError):
        pool.attention_view("missing")


def test_num_blocks_for_memory() -> None:
    assert num_blocks_for_memory(config(), 10 * PAGE + 100) == 10
    with pytest.raises(ValueError, match="fewer than 2 pages"):
        num_blocks_for_memory(config(), 2 * PAGE - 1)


@pytest.mark.parametrize("layer", ["m1", "g0"])  # state in one block / spread over 3 blocks
def test_gather_and_scatter_states_match_per_request_access(pool: KVPool, layer: str) -> None:
    gen = torch.Generator().manual_seed(1)
    span = pool.config.group_of(layer).blocks_per_state
    tables = [[6, 2, 4], [1, 3, 7]] if span == 3 else [[5], [2], [6]]
    spec = pool.config.group_of(layer).spec
    dtypes = (torch.float16, torch.float32) if layer == "m1" else (torch.bfloat16, torch.float32)
    pairs = list(zip(spec.shapes, dtypes, strict=True))
    states = [[torch.randn(shape, generator=gen).to(dt) for shape, dt in pairs] for _ in tables]
    ids = torch.tensor(tables)
    pool.scatter_states(layer, ids, [torch.stack(s) for s in zip(*states, strict=True)])
    for table, want in zip(tables, states, strict=True):
        got = pool.read_state(layer, table)
        assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
    # and back: the gathered rows are the per-request states, as copies
    gathered = pool.gather_states(layer, ids)
    for i, want in enumerate(states):
        assert all(torch.equal(g[i], w) for g, w in zip(gathered, want, strict=True))
    gathered[1].fill_(0)
    assert torch.equal(pool.read_state(layer, tables[0])[1], states[0][1])
    with pytest.raises(ValueError, match="state block ids"):
        pool.gather_states(layer, ids[:, :1] if span == 3 else ids.repeat(1, 2))
    untouched = [b for b in range(8) if b not in ids.flatten().tolist()]
    assert not pool.buffer[untouched].count_nonzero()


def test_state_rows_move_every_bit_pattern() -> None:
    """Indexed row copies go through 16-byte elements: random bits (NaN payloads, signalling
    ones included) must arrive unchanged through write_state, scatter_states and both reads."""
    pool = KVPool(config(), num_blocks=8, device=str(torch.device("cpu")))
    gen = torch.Generator().manual_seed(2)
    spec = pool.config.group_of("g0").spec
    conv = torch.randint(0, 1 << 16, spec.shapes[0], generator=gen, dtype=torch.int32)
    conv = conv.to(torch.int16).view(torch.bfloat16)
    ssm = torch.randint(-(1 << 31), 1 << 31, spec.shapes[1], generator=gen, dtype=torch.int64)
    ssm = ssm.to(torch.int32)
    ssm.view(-1)[:3] = torch.tensor([0x7F800001, 0x7FC00001, -0x7FFFFF])  # sNaN, qNaN, -sNaN
    ssm = ssm.view(torch.float32)

    def bits(t: torch.Tensor) -> torch.Tensor:
        return t.contiguous().view(torch.uint8)

    pool.write_state("g0", [6, 2, 4], [conv, ssm])
    got = pool.gather_states("g0", torch.tensor([[6, 2, 4]]))
    assert torch.equal(bits(got[0][0]), bits(conv)) and torch.equal(bits(got[1][0]), bits(ssm))
    pool.scatter_states("g0", torch.tensor([[1, 3, 7]]), [conv[None], ssm[None]])
    back = pool.read_state("g0", [1, 3, 7])
    assert torch.equal(bits(back[0]), bits(conv)) and torch.equal(bits(back[1]), bits(ssm))


def _random_states(layer: str, rows: int, seed: int) -> list[torch.Tensor]:
    spec = config().group_of(layer).spec
    gen = torch.Generator().manual_seed(seed)
    dtypes = (torch.float16, torch.float32) if layer == "m1" else (torch.bfloat16, torch.float32)
    return [
        torch.randn((rows, *shape), generator=gen).to(dt)
        for shape, dt in zip(spec.shapes, dtypes, strict=True)
    ]


def _equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    """Bit for bit (random page bytes make NaNs)."""

    def bits(t: torch.Tensor) -> torch.Tensor:
        return t.contiguous().view(torch.uint8)

    return all(torch.equal(bits(x), bits(y)) for x, y in zip(a, b, strict=True))


def _tables(span: int, allocator: BlockPool) -> list[list[int]]:
    return [[b.block_id for b in allocator.allocate(span)] for _ in range(2 if span == 3 else 3)]


@pytest.mark.parametrize("layer", ["m1", "g0"])
def test_held_rows_stay_off_the_pages_until_something_else_needs_them(pool, layer) -> None:
    """With held rows on, scatter_states keeps the rows and the next gather of the same
    blocks in the same order gets them back; the pages get them before anything else
    could see them: the allocator freeing one of their blocks, read_state, write_state,
    copy_blocks, a gather of other rows, flush_rows."""
    pool = KVPool(config(), num_blocks=16, device=pool.device)  # room for other blocks
    allocator = BlockPool(16)
    span = pool.config.group_of(layer).blocks_per_state
    tables = _tables(span, allocator)
    ids = torch.tensor(tables)
    rows = len(tables)

    def pages(table: list[int]) -> torch.Tensor:
        return pool.buffer[table].clone()

    def read_rows() -> list[torch.Tensor]:
        per_row = [pool.read_state(layer, t) for t in tables]
        return [torch.stack(ts) for ts in zip(*per_row, strict=True)]

    def step(seed: int) -> list[torch.Tensor]:
        """A decode step: gather, update in place, scatter back; returns the new states."""
        got = pool.gather_states(layer, ids)
        new = _random_states(layer, rows, seed)
        for t, n in zip(got, new, strict=True):
            t.copy_(n)
        pool.scatter_states(layer, ids, got)
        return new

    new = step(0)  # off: written at once
    assert _equal(read_rows(), new)
    pool.hold_rows_for(allocator)
    before = [pages(t) for t in tables]
    new = step(1)
    assert all(torch.equal(pages(t), b) for t, b in zip(tables, before, strict=True))
    assert pool.held_rows_total > 0
    got = pool.gather_states(layer, ids)
    assert pool.held_hits == 1 and _equal(got, new)
    pool.scatter_states(layer, ids, got)

    # read_state writes them first
    assert _equal(read_rows(), new) and pool.held_rows_total == 0
    # freeing a block writes them before it can change owner
    new = step(2)
    allocator.free([allocator.get_block(BlockId(tables[-1][0]))])
    assert pool.held_rows_total == 0
    behind = tables[-1]  # the new owner's bytes arrive behind the pool's back (a transfer)
    garbage = torch.randint(0, 255, (len(behind), PAGE), dtype=torch.uint8)
    pool.buffer[behind] = garbage
    assert _equal([t[:-1] for t in read_rows()], [t[:-1] for t in new])
    assert torch.equal(pool.buffer[behind], garbage)
    allocator.touch([allocator.get_block(BlockId(tables[-1][0]))])  # owned again, for the test

    # a gather of other rows (the same blocks in another order) writes them first
    new = step(3)
    hits = pool.held_hits
    assert _equal(pool.gather_states(layer, ids.flip(0)), [t.flip(0) for t in new])
    assert pool.held_hits == hits
    pool.flush_rows()
    # write_state / copy_blocks into one of their blocks: written first, then overwritten
    for write, row in (
        (
            lambda: pool.write_state(
                layer, tables[-1], [t[0] for t in _random_states(layer, 1, 4)]
            ),
            -1,
        ),
        (lambda: pool.copy_blocks(list(zip(tables[-1], tables[0], strict=True))), 0),
    ):
        new = step(5)
        write()
        assert pool.held_rows_total == 0
        got = read_rows()
        keep = [i for i in range(rows) if i != (row % rows)]
        assert _equal([t[keep] for t in got], [t[keep] for t in new])
    # flush_rows of other blocks keeps them
    step(6)
    pool.flush_rows([b for b in range(1, 16) if b not in ids.flatten().tolist()])
    assert pool.held_rows_total > 0
    pool.flush_rows()
    assert pool.held_rows_total == 0


def test_held_rows_respect_the_budget() -> None:
    allocator = BlockPool(8)
    ids = torch.tensor(_tables(3, allocator))
    nbytes = 2 * 3 * config().group_of("g0").slot_bytes
    for budget, held in ((nbytes - 1, 0), (nbytes, nbytes)):
        pool = KVPool(config(), num_blocks=8, held_rows_bytes=budget)
        pool.hold_rows_for(allocator)
        pool.scatter_states("g0", ids, pool.gather_states("g0", ids))
        assert pool.held_rows_total == held
    default = KVPool(config(), num_blocks=8)
    assert default.held_rows_bytes == 8 * PAGE // 4


@pytest.mark.parametrize("rows", [1, 3])
def test_scattering_the_gathered_views_keeps_their_buffer(rows: int) -> None:
    """A decode step hands back the views `gather_states` gave it (states over several
    blocks): the pool keeps their buffer rather than copying them into a new one, one row
    included (a one-row view's stride says nothing about the buffer's rows)."""
    allocator = BlockPool(16)
    pool = KVPool(config(), num_blocks=16)
    pool.hold_rows_for(allocator)
    ids = torch.tensor([[b.block_id for b in allocator.allocate(3)] for _ in range(rows)])
    got = pool.gather_states("g0", ids)
    pointers = [t.data_ptr() for t in got]
    pool.scatter_states("g0", ids, got)
    assert [t.data_ptr() for t in pool.gather_states("g0", ids)] == pointers
