"""CPU linears through oneDNN (hybrid_pd/engine/onednn.py): same results as `F.linear` to
float32 rounding, the same parameters, and switched on by the loader."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from hybrid_pd.engine import cpu_kernels
from hybrid_pd.engine.onednn import (
    FusedLinears,
    OneDnnLinear,
    Panels,
    linear,
    onednn_available,
    onednn_dtype,
    pack_weight,
    packed_linear,
    use_onednn_linears,
)

needs_onednn = pytest.mark.skipif(not onednn_available(), reason="no oneDNN in this torch")


@pytest.mark.parametrize("shape", [(1, 64), (7, 64), (3, 5, 64), (0, 64)])
@pytest.mark.parametrize("bias", [False, True])
def test_linear_matches_f_linear(shape, bias):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(*shape, generator=g)
    w = torch.randn(96, 64, generator=g)
    b = torch.randn(96, generator=g) if bias else None
    out = linear(x, w, b)
    assert out.shape == (*shape[:-1], 96)
    torch.testing.assert_close(out, F.linear(x, w, b), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("rows", [1, 9])
def test_bfloat16_runs_on_any_processor(rows):
    """bfloat16 goes through oneDNN only where the processor has its bfloat16 kernels
    (oneDNN refuses it on AVX2-only CPUs); elsewhere a packed weight goes into the C
    kernels' bfloat16 panels (where they are built) and the free functions take PyTorch's
    own path. Either way the layer, its packed weight and the free functions give
    F.linear's result."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(rows, 64, generator=g).bfloat16()
    layer = nn.Linear(64, 96).bfloat16()
    use_onednn_linears(layer)
    want = F.linear(x.float(), layer.weight.float(), layer.bias.float())
    for got in (layer(x), linear(x, layer.weight, layer.bias)):
        assert got.dtype is torch.bfloat16
        torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=5e-2)
    packed = pack_weight(layer.weight)
    if onednn_dtype(torch.bfloat16):
        assert packed is not None and not isinstance(packed, Panels)
    else:
        assert isinstance(packed, Panels) or cpu_kernels.library() is None
    torch.testing.assert_close(
        packed_linear(x, layer.weight, packed).float(),
        F.linear(x.float(), layer.weight.float()),
        rtol=2e-2,
        atol=5e-2,
    )


def test_linear_falls_back_on_mixed_dtypes():
    x, w = torch.randn(4, 8), torch.randn(3, 8, dtype=torch.float64)
    with pytest.raises(RuntimeError):
        linear(x, w)  # F.linear's own error, not a oneDNN one


@needs_onednn
def test_switch_keeps_parameters_and_names():
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4, bias=False))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    x = torch.randn(5, 8)
    expected = model(x)
    assert use_onednn_linears(model) == 2
    assert isinstance(model[0], OneDnnLinear) and isinstance(model[2], OneDnnLinear)
    assert model.state_dict().keys() == before.keys()
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k])
    torch.testing.assert_close(model(x), expected, rtol=1e-5, atol=1e-5)
    assert use_onednn_linears(model) == 0  # already switched


@needs_onednn
def test_loader_switches_cpu_linears(tmp_path):
    from hybrid_pd.engine.loader import load_model
    from tests import checkpoints

    model, _, _ = load_model(checkpoints.llama(tmp_path))
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    assert linears and all(type(m) is OneDnnLinear for m in linears)


def expect_close(layer: nn.Linear, x: torch.Tensor) -> None:
    expected = F.linear(x, layer.weight, layer.bias)
    torch.testing.assert_close(layer(x), expected, rtol=1e-5, atol=1e-4)


@needs_onednn
def test_packed_weight_follows_the_parameter():
    layer = nn.Linear(64, 96)
    use_onednn_linears(layer)
    x = torch.randn(7, 64)
    torch.testing.assert_close(
        layer(x), F.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-4
    )
    with torch.no_grad():
        layer.weight.mul_(2.0)  # in place: the packed copy must be rebuilt
    torch.testing.assert_close(
        layer(x), F.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-4
    )
    layer.weight = nn.Parameter(torch.randn(96, 64))  # replaced
    torch.testing.assert_close(
        layer(x), F.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-4
    )
    with torch.no_grad():
        layer.to(torch.float64)  # a dtype oneDNN does not take here: plain F.linear
    xd = x.double()
    torch.testing.assert_close(layer(xd), F.linear(xd, layer.weight, layer.bias))


def _siblings(biases, dtype=torch.float32):
    g = torch.Generator().manual_seed(3)
    layers = [nn.Linear(64, n, bias=b) for n, b in zip((96, 32, 8), biases, strict=True)]
    with torch.no_grad():
        for m in layers:
            m.weight.copy_(torch.randn(m.weight.shape, generator=g))
            if m.bias is not None:
                m.bias.copy_(torch.randn(m.bias.shape, generator=g))
    for m in layers:
        m.to(dtype)
        use_onednn_linears(m)
    return layers


@pytest.mark.parametrize("rows", [1, 5, 40])
@pytest.mark.parametrize("biases", [(False,) * 3, (True,) * 3, (True, False, True)])
def test_fused_linears_give_each_linear_its_own_output(rows, biases):
    layers = _siblings(biases)
    fused = FusedLinears(*layers)
    x = torch.randn(rows, 64, generator=torch.Generator().manual_seed(4))
    outs = fused(x)
    assert [o.shape for o in outs] == [(rows, 96), (rows, 32), (rows, 8)]
    for out, m in zip(outs, layers, strict=True):
        torch.testing.assert_close(out, F.linear(x, m.weight, m.bias), rtol=1e-5, atol=1e-4)
    # the outputs are views of one GEMM's result wherever oneDNN ran it (one row runs the C
    # kernel, `cpu_kernels.gemv`, for each linear on its own)
    if onednn_available() and rows > 1:
        assert outs[0].untyped_storage().data_ptr() == outs[2].untyped_storage().data_ptr()


def test_fused_linears_follow_their_parameters_and_copies():
    import copy

    layers = _siblings((True, True, False))
    fused = FusedLinears(*layers)
    x = torch.randn(3, 64)
    fused(x)
    with torch.no_grad():
        layers[1].weight.mul_(-2)  # in place: the packed copy must be rebuilt
        layers[0].bias.add_(1)
    for out, m in zip(fused(x), layers, strict=True):
        torch.testing.assert_close(out, F.linear(x, m.weight, m.bias), rtol=1e-5, atol=1e-4)
    # a deep copy (a model copied after use) gets its own linears and packs its own weights
    twin = copy.deepcopy(fused)
    with torch.no_grad():
        twin.linears[2].weight.zero_()
    assert torch.equal(twin(x)[2], torch.zeros(3, 8))
    torch.testing.assert_close(fused(x)[2], F.linear(x, layers[2].weight), rtol=1e-5, atol=1e-4)


def test_fused_linears_fall_back_where_onednn_does_not_run():
    """float64 (no oneDNN kernel) and an input of another dtype than the weights: each
    linear runs on its own, with F.linear's exact result."""
    layers = _siblings((True, False, True), dtype=torch.float64)
    fused = FusedLinears(*layers)
    x = torch.randn(4, 64, dtype=torch.float64)
    for out, m in zip(fused(x), layers, strict=True):
        assert torch.equal(out, F.linear(x, m.weight, m.bias))
    with pytest.raises(RuntimeError):
        fused(x.float())  # what each linear itself says about mixed dtypes
