"""The core's matrix products (quotient_manifolds.core.products): CPU float64 products through
numpy's BLAS, everything else in torch, the same values either way."""

import warnings

import numpy as np
import pytest
import torch

from quotient_manifolds.core import products
from quotient_manifolds.core.products import add_product, matmul


@pytest.fixture
def numpy_calls(monkeypatch):
    """The products numpy computed, with torch on one thread (the numpy path's condition)."""
    calls = []
    real = np.matmul

    def counted(a, b, *args, **kwargs):
        calls.append((a.shape, b.shape))
        return real(a, b, *args, **kwargs)

    monkeypatch.setattr(products.np, "matmul", counted)
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield calls
    torch.set_num_threads(previous)


def _pairs():
    g = torch.Generator().manual_seed(0)

    def r(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64)

    x = r(3, 2, 14, 4)
    yield r(7, 5), r(5, 3)                                   # single matrices
    yield r(6, 9, 4), r(6, 4, 4)                             # batched
    yield r(2, 6, 9, 4), r(6, 4, 4)                          # broadcast batch
    yield x.unflatten(-2, (2, 7)).mT, x.unflatten(-2, (2, 7))  # Gram reduction of views
    yield x[..., :7, :], r(4, 4)                             # a split view, broadcast matrix
    yield r(5, 4).mT, r(5, 4)                                # transposed 2D view


@pytest.mark.parametrize("pair", list(_pairs()), ids=lambda p: f"{tuple(p[0].shape)}@{tuple(p[1].shape)}")
def test_cpu_float64_products_go_through_numpy_with_torchs_values(pair, numpy_calls):
    a, b = pair
    want = a @ b
    got = matmul(a, b)
    assert numpy_calls, "the product did not go through numpy"
    assert got.shape == want.shape and got.dtype == torch.float64
    torch.testing.assert_close(got, want, rtol=1e-13, atol=1e-13)
    out = torch.randn(want.shape, dtype=torch.float64)
    expected = out + want
    got = add_product(out, a, b)
    assert got is out                     # in place into the fresh tensor
    torch.testing.assert_close(got, expected, rtol=1e-13, atol=1e-13)


def test_add_product_broadcasts_out_of_place(numpy_calls):
    a, b = torch.randn(2, 3, 5, 4, dtype=torch.float64), torch.randn(3, 4, 2, dtype=torch.float64)
    out = torch.randn(3, 5, 2, dtype=torch.float64)
    got = add_product(out, a, b)
    assert got.shape == (2, 3, 5, 2) and numpy_calls
    torch.testing.assert_close(got, out + a @ b)


def test_add_product_bumps_the_version_of_out():
    out = torch.zeros(4, 3, dtype=torch.float64)
    before = out._version
    add_product(out, torch.ones(4, 2, dtype=torch.float64), torch.ones(2, 3, dtype=torch.float64))
    assert out._version > before and torch.equal(out, torch.full((4, 3), 2.0, dtype=torch.float64))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_other_dtypes_stay_in_torch(dtype, numpy_calls):
    a, b = torch.randn(6, 5, dtype=dtype), torch.randn(5, 3, dtype=dtype)
    assert torch.equal(matmul(a, b), a @ b) and not numpy_calls


def test_products_autograd_records_stay_in_torch(numpy_calls):
    a = torch.randn(6, 5, dtype=torch.float64, requires_grad=True)
    b = torch.randn(5, 3, dtype=torch.float64)
    y = matmul(a, b)
    assert y.grad_fn is not None and not numpy_calls
    (grad,) = torch.autograd.grad(y.sum(), a)
    torch.testing.assert_close(grad, torch.ones(6, 3, dtype=torch.float64) @ b.mT)
    with torch.no_grad():   # nothing to record: numpy
        matmul(a, b)
    assert numpy_calls


def test_the_switch_keeps_every_product_in_torch(monkeypatch, numpy_calls):
    monkeypatch.setattr(products, "NUMPY_ON_CPU", False)
    a, b = torch.randn(6, 5, dtype=torch.float64), torch.randn(5, 3, dtype=torch.float64)
    assert torch.equal(matmul(a, b), a @ b)
    assert torch.equal(add_product(torch.zeros(6, 3, dtype=torch.float64), a, b), a @ b)
    assert not numpy_calls


def test_tensors_numpy_cannot_view_stay_in_torch(numpy_calls):
    a = torch._neg_view(torch.randn(6, 5, dtype=torch.float64))   # a lazily negated view
    b = torch.randn(5, 3, dtype=torch.float64)
    assert a.is_neg()
    torch.testing.assert_close(matmul(a, b), a.resolve_neg() @ b)
    assert not numpy_calls


def test_overflow_gives_inf_silently_as_in_torch():
    a = torch.full((3, 4), 1e300, dtype=torch.float64)
    b = torch.full((4, 2), 1e300, dtype=torch.float64)
    b[0, 0] = float("nan")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = matmul(a, b)
    want = a @ b
    assert torch.equal(got.isinf(), want.isinf()) and torch.equal(got.isnan(), want.isnan())


class _FakeBlas:
    def __init__(self, threads):
        self.num_threads, self.calls = threads, []

    def set_num_threads(self, n):
        self.calls.append(n)
        self.num_threads = n


def test_products_stay_in_torch_where_torch_has_several_threads(numpy_calls):
    """torch's batched products use its threads; numpy's BLAS would run these on one."""
    a, b = torch.randn(4, 6, 5, dtype=torch.float64), torch.randn(4, 5, 3, dtype=torch.float64)
    previous = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        assert torch.get_num_threads() == 2
        assert torch.equal(matmul(a, b), a @ b)
    finally:
        torch.set_num_threads(previous)
    assert not numpy_calls


def test_large_products_run_on_one_blas_thread(monkeypatch, numpy_calls):
    blas = _FakeBlas(8)
    monkeypatch.setattr(products, "_blas_controllers", lambda: [blas])
    monkeypatch.setattr(products, "THREADED_WORK", 10)
    a, b = torch.randn(3, 6, 5, dtype=torch.float64), torch.randn(3, 5, 4, dtype=torch.float64)
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        torch.testing.assert_close(matmul(a, b), a @ b)
    finally:
        torch.set_num_threads(previous)
    assert blas.calls == [1, 8] and blas.num_threads == 8 and numpy_calls   # one, then restored
    blas.calls.clear()
    matmul(torch.randn(2, 2, dtype=torch.float64), torch.randn(2, 2, dtype=torch.float64))
    assert blas.calls == []   # small: BLAS runs it on one thread anyway


def test_large_products_stay_in_torch_without_threadpoolctl(monkeypatch, numpy_calls):
    monkeypatch.setattr(products, "_blas_controllers", lambda: None)
    monkeypatch.setattr(products, "THREADED_WORK", 10)
    a, b = torch.randn(6, 5, dtype=torch.float64), torch.randn(5, 4, dtype=torch.float64)
    assert torch.equal(matmul(a, b), a @ b)
    out = torch.zeros(6, 4, dtype=torch.float64)
    assert torch.equal(add_product(out, a, b), a @ b) and not numpy_calls


def test_function_transforms_differentiate_through_the_products():
    """torch.func's grad, jvp and vmap wrap tensors numpy cannot see through: the products stay
    in torch there, so derivatives and batching are right."""
    a = torch.randn(5, 3, dtype=torch.float64)
    b = torch.randn(3, 4, dtype=torch.float64)
    grad = torch.func.grad(lambda t: matmul(t, b).sum())(a)
    torch.testing.assert_close(grad, torch.ones(5, 4, dtype=torch.float64) @ b.mT)
    _, tangent = torch.func.jvp(lambda t: add_product(torch.zeros(5, 4, dtype=torch.float64), t, b),
                                (a,), (torch.ones_like(a),))
    torch.testing.assert_close(tangent, torch.ones_like(a) @ b)
    batched = torch.randn(7, 5, 3, dtype=torch.float64)
    torch.testing.assert_close(torch.func.vmap(lambda t: matmul(t, b))(batched), batched @ b)
