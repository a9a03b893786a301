"""Grouping: block size, page size and KV cache groups (vLLM hybrid manager design doc)."""

from __future__ import annotations

import pytest

from hybrid_pd.kvcache.config import (
    SLOT_ALIGN,
    KVCacheConfig,
    KVCacheGroup,
    slot_bytes_for,
    state_tensor_offsets,
)
from hybrid_pd.kvcache.grouping import HMAOffError, plan_groups, vllm_style_config
from hybrid_pd.kvcache.manager import KVCacheManager
from hybrid_pd.kvcache.specs import (
    AttentionSpec,
    FullAttentionSpec,
    ModelCacheSpec,
    SlidingWindowSpec,
    StateSpec,
    gdn_state_spec,
)

FULL = FullAttentionSpec(2, 64, "bf16")
SW32 = SlidingWindowSpec(2, 64, "bf16", window=32)


def doc_model() -> ModelCacheSpec:
    """The design doc example: 10 full + 20 sliding-window layers of equal KV size."""
    layers = {f"full.{i}": FULL for i in range(10)}
    layers |= {f"sw.{i}": SW32 for i in range(20)}
    return ModelCacheSpec("doc", layers)


def gemma3_like() -> ModelCacheSpec:
    """Gemma-3-27B layout: 62 layers, every sixth one global, 52 sliding (window 1024)."""
    full = FullAttentionSpec(16, 128, "bf16")
    sw = SlidingWindowSpec(16, 128, "bf16", window=1024)
    return ModelCacheSpec("gemma3", {f"l{i}": full if i % 6 == 5 else sw for i in range(62)})


def gdn_hybrid(num_full: int = 12, num_gdn: int = 36) -> ModelCacheSpec:
    """Qwen3-Next-like: a full attention layer after every three GDN layers."""
    full = FullAttentionSpec(2, 256, "bf16")
    gdn = gdn_state_spec(
        num_k_heads=16, num_v_heads=32, head_k_dim=128, head_v_dim=128, conv_kernel=4
    )
    layers = {}
    for i in range(num_full + num_gdn):
        layers[f"l{i}"] = full if i % 4 == 3 else gdn
    return ModelCacheSpec("gdn_hybrid", layers)


def assert_well_formed(config: KVCacheConfig, model: ModelCacheSpec) -> None:
    """Every owning layer in exactly one group of its spec; every group fits one page."""
    names = [n for g in config.groups for n in g.layer_names]
    assert sorted(names) == sorted(model.layers)
    assert config.num_layers == len(model.layers)
    assert config.page_size_bytes % SLOT_ALIGN == 0
    for i, g in enumerate(config.groups):
        assert g.group_id == i
        assert len(g.layer_names) * g.slot_bytes <= config.page_size_bytes
        assert g.slot_bytes % SLOT_ALIGN == 0
        for n in g.layer_names:
            spec = model.layers[n]
            assert g.spec == (spec if config.hma else spec.as_full())  # type: ignore[attr-defined]
        if isinstance(g.spec, StateSpec):
            _, total = state_tensor_offsets(g.spec)
            assert g.blocks_per_state * g.slot_bytes >= total
            assert (g.blocks_per_state - 1) * g.slot_bytes < total
        else:
            assert g.blocks_per_state == 1
            assert g.slot_bytes >= g.spec.page_bytes(config.block_size)


# -- the design doc example -----------------------------------------------------------------


def test_doc_example_needs_11_blocks_for_112_tokens() -> None:
    config = plan_groups(doc_model(), block_size=16)
    assert_well_formed(config, doc_model())
    assert config.block_size == 16
    assert [(g.kind, len(g.layer_names)) for g in config.groups] == [
        ("full", 10),
        ("sliding_window", 10),
        ("sliding_window", 10),
    ]
    assert config.page_size_bytes == 10 * FULL.page_bytes(16)
    assert [g.blocks_needed(112, 16) for g in config.groups] == [7, 2, 2]
    assert config.blocks_per_request(112) == 11
    assert config.padding_waste(112) == 0.0
    vllm = vllm_style_config(doc_model())
    assert vllm.blocks_per_request(112) == 11 and len(vllm.groups) == 3


def test_doc_example_through_the_manager() -> None:
    config = plan_groups(doc_model(), block_size=16)
    mgr = KVCacheManager(config, num_blocks=1 + 7 * 3)
    tokens = list(range(112))
    ids = mgr.allocate_slots("r", tokens, 112)
    assert ids is not None and [len(x) for x in ids] == [7, 7, 7]
    assert mgr.pool.num_free_blocks == 0  # the prefill chunk needs all 21 blocks
    mgr.check_integrity()
    mgr.commit_computed("r", 112)
    mgr.release_out_of_window("r")
    mgr.check_integrity()
    full, sw1, sw2 = mgr.block_ids("r")
    assert 0 not in full and len(set(full)) == 7
    for sw in (sw1, sw2):
        assert sw[:5] == [0, 0, 0, 0, 0] and 0 not in sw[5:]  # positions 81.. are read next
    held = {b for group in (full, sw1, sw2) for b in group if b != 0}
    assert len(held) == 11 == config.blocks_per_request(112)
    assert mgr.pool.num_free_blocks == 21 - 11
    mgr.free("r")
    mgr.check_integrity()
    assert mgr.pool.num_free_blocks == 21


# -- other layouts --------------------------------------------------------------------------


@pytest.mark.parametrize("ref_len", [4096, 131072])
@pytest.mark.parametrize("block_size", [None, 16])
def test_gemma3_like_wastes_no_more_than_vllm(ref_len: int, block_size: int | None) -> None:
    model = gemma3_like()
    ours = plan_groups(model, ref_len=ref_len, block_size=block_size)
    vllm = vllm_style_config(model)
    assert_well_formed(ours, model)
    assert_well_formed(vllm, model)
    assert ours.padding_waste(ref_len) <= vllm.padding_waste(ref_len)
    assert ours.bytes_per_request(ref_len) <= vllm.bytes_per_request(ref_len)
    assert vllm.page_size_bytes == 10 * vllm.groups[0].slot_bytes  # min layer count per type


@pytest.mark.parametrize("n", [1, 7, 32])
def test_uniform_full_attention_is_one_group_with_no_waste(n: int) -> None:
    model = ModelCacheSpec("llama", {f"l{i}": FULL for i in range(n)})
    config = plan_groups(model, block_size=16)
    assert_well_formed(config, model)
    assert len(config.groups) == 1 and config.groups[0].layer_names == tuple(model.layers)
    assert config.page_size_bytes == n * FULL.page_bytes(16)
    assert config.padding_slots(config.groups[0]) == 0
    assert config.padding_waste(4096) == 0.0 == config.padding_waste(17)
    assert config.blocks_per_request(17) == 2


@pytest.mark.parametrize(("n_full", "n_sw"), [(7, 11), (3, 29), (5, 5)])
def test_irregular_ratio(n_full: int, n_sw: int) -> None:
    sw = SlidingWindowSpec(4, 64, "bf16", window=100)  # kv size differs from FULL too
    layers = {f"f{i}": FULL for i in range(n_full)} | {f"s{i}": sw for i in range(n_sw)}
    model = ModelCacheSpec("irregular", layers)
    for block_size in (None, 16):
        ours = plan_groups(model, block_size=block_size, ref_len=8192)
        assert_well_formed(ours, model)
        vllm = vllm_style_config(model)
        assert_well_formed(vllm, model)
        assert ours.padding_waste(8192) <= vllm.padding_waste(8192)
        assert ours.bytes_per_request(8192) <= vllm.bytes_per_request(8192)
        # Layers of one spec are spread evenly: group sizes differ by at most one.
        for kind in ("full", "sliding_window"):
            sizes = [len(g.layer_names) for g in ours.groups if g.kind == kind]
            assert max(sizes) - min(sizes) <= 1


@pytest.mark.parametrize("ref_len", [4096, 262144])
def test_gdn_hybrid_state_much_larger_than_an_attention_page(ref_len: int) -> None:
    model = gdn_hybrid()
    state = model.layers["l0"]
    assert isinstance(state, StateSpec)
    assert state.state_bytes > 30 * FullAttentionSpec(2, 256).page_bytes(16)
    ours = plan_groups(model, ref_len=ref_len)
    vllm = vllm_style_config(model)
    assert_well_formed(ours, model)
    assert_well_formed(vllm, model)
    assert ours.block_size <= 64
    assert vllm.block_size == 544  # raised until one attention page holds a state
    assert ours.padding_waste(ref_len) <= vllm.padding_waste(ref_len)
    assert ours.bytes_per_request(ref_len) <= vllm.bytes_per_request(ref_len)
    kinds = {g.kind for g in ours.groups}
    assert kinds == {"full", "state"}
    state_groups = [g for g in ours.groups if g.is_state]
    assert sum(len(g.layer_names) for g in state_groups) == 36
    for g in state_groups:
        assert g.blocks_needed(ref_len, ours.block_size) == g.blocks_per_state


def test_fixed_block_size_is_honoured() -> None:
    for bs in (8, 16, 48):
        assert plan_groups(doc_model(), block_size=bs).block_size == bs
        config = plan_groups(gdn_hybrid(), block_size=bs)
        assert config.block_size == bs
        assert_well_formed(config, gdn_hybrid())
    with pytest.raises(ValueError, match="positive"):
        plan_groups(doc_model(), block_size=0)


def test_block_align_limits_the_searched_sizes() -> None:
    config = plan_groups(gemma3_like(), block_align=16, max_block_size=64)
    assert config.block_size in (16, 32, 48, 64)
    with pytest.raises(ValueError, match="multiple of 32"):
        plan_groups(gemma3_like(), block_align=32, max_block_size=16)


# -- HMA off ----------------------------------------------------------------------------------


def test_hma_off_turns_sliding_window_into_full_attention() -> None:
    config = plan_groups(doc_model(), block_size=16, hma=False)
    assert_well_formed(config, doc_model())
    assert not config.hma
    assert len(config.groups) == 1
    group = config.groups[0]
    assert type(group.spec) is FullAttentionSpec and len(group.layer_names) == 30
    assert config.blocks_per_request(112) == 7  # every layer keeps all 112 tokens
    vllm = vllm_style_config(doc_model(), hma=False)
    assert len(vllm.groups) == 1 and type(vllm.groups[0].spec) is FullAttentionSpec


def test_hma_off_with_state_layers_names_them() -> None:
    small = ModelCacheSpec(
        "small",
        {
            "attn": FULL,
            "mamba.0": StateSpec(((4,),), ("fp32",)),
            "mamba.1": StateSpec(((4,),), ("fp32",)),
        },
    )
    with pytest.raises(HMAOffError) as err:
        plan_groups(small, hma=False)
    msg = str(err.value)
    assert "small" in msg and "mamba.0, mamba.1" in msg
    assert "keep the hybrid KV cache manager on" in msg
    assert isinstance(err.value, ValueError)
    with pytest.raises(HMAOffError, match=r"l0, l1, l2, l4, l5, l6, \.\.\. \(36 in all\)"):
        plan_groups(gdn_hybrid(), hma=False)
    with pytest.raises(HMAOffError):
        vllm_style_config(gdn_hybrid(), hma=False)


# -- KV sharing and config checks -------------------------------------------------------------


def test_kv_sharing_layers_own_no_cache() -> None:
    layers = {f"f{i}": FULL for i in range(4)} | {f"s{i}": SW32 for i in range(4)}
    model = ModelCacheSpec("gemma3n", layers, shared={"kv.a": "f1", "kv.b": "s3"})
    config = plan_groups(model, block_size=16)
    assert_well_formed(config, model)
    owners = {n for g in config.groups for n in g.layer_names}
    assert "kv.a" not in owners and "kv.b" not in owners
    assert config.group_of("kv.a") is config.group_of("f1")
    assert config.group_of("kv.b") is config.group_of("s3")
    assert config.group_of("kv.b").kind == "sliding_window"
    with pytest.raises(KeyError, match="owns no KV cache"):
        config.group_of("nope")


def test_config_rejects_groups_that_do_not_fit_a_page() -> None:
    slot = slot_bytes_for(FULL, 16)
    group = KVCacheGroup(0, FULL, ("a", "b"), slot)
    assert KVCacheConfig(16, 2 * slot, (group,)).padding_slots(group) == 0
    assert KVCacheConfig(16, 3 * slot, (group,)).padding_slots(group) == 1
    with pytest.raises(ValueError, match="does not fit"):
        KVCacheConfig(16, 2 * slot - SLOT_ALIGN, (group,))
    with pytest.raises(ValueError, match="SLOT_ALIGN"):
        KVCacheConfig(16, 2 * slot + 8, (group,))


def test_padding_waste_counts_unused_slots() -> None:
    slot = slot_bytes_for(FULL, 16)
    group = KVCacheGroup(0, FULL, ("a", "b", "c"), slot)
    config = KVCacheConfig(16, 4 * slot, (group,))  # one of four slots is padding
    assert config.padding_waste(100) == pytest.approx(0.25)
    assert config.bytes_per_request(100) == 7 * 4 * slot
    assert config.padding_waste(0) == 0.0
    assert isinstance(group.spec, AttentionSpec)
