"""The Riemannian Hessian operator (adapters.hessian) against dense brute force: eigenvalues and trace
of a tiny attention model from the metric, its derivatives and the vertical space assembled
independently; invariance under per-head GL reparametrisations (the Euclidean Hessian is not
invariant); a rotary block with its group; symmetry; curvlinops estimators; data normalisation;
the model is never modified."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.func import functional_call, jacfwd
from torch.nn.attention import SDPBackend, sdpa_kernel

from quotient_manifolds import adapters
from quotient_manifolds.adapters.hessian import RiemannianHessian, riemannian_hessian, top_eigenvalues, trace
from quotient_manifolds.adapters.components import QuotientComponent
from quotient_manifolds.core.groups import RotaryGroup
from quotient_manifolds.errors import InvalidArgument
from conftest import reparametrised_copy

DT = torch.float64


# ------------------------------------------------------------------------------------ models
class TinyAttention(nn.Module):
    """One attention layer (2 heads of dim 2) and a linear head: 95 weights."""

    def __init__(self):
        super().__init__()
        self.attn = nn.MultiheadAttention(4, 2, batch_first=True)
        self.head = nn.Linear(4, 3)

    def forward(self, x):
        return self.head(self.attn(x, x, x, need_weights=False)[0].mean(1))


def tiny_attention():
    torch.manual_seed(0)
    model = TinyAttention().to(DT).eval()
    with torch.no_grad():  # torch initialises the attention biases at 0: give trained-like values
        for p in (model.attn.in_proj_bias, model.attn.out_proj.bias):
            p.copy_(0.3 * torch.randn_like(p))
    return model


def tiny_batches(sizes=(6,), seed=1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(n, 3, 4, generator=g, dtype=DT), torch.randint(0, 3, (n,), generator=g))
            for n in sizes]


def dense(op):
    return op @ torch.eye(op.shape[1], dtype=op.dtype)


def rel(a, b):
    return abs(a - b) / max(abs(a), abs(b))


# ------------------------------------------------------------------------------- brute force
def flat(model):
    names = [n for n, _ in model.named_parameters()]
    shapes = [p.shape for _, p in model.named_parameters()]
    theta = torch.cat([p.detach().reshape(-1) for _, p in model.named_parameters()])

    def unflatten(t):
        out, start = {}, 0
        for n, s in zip(names, shapes):
            k = int(np.prod(s))
            out[n] = t[start:start + k].view(s)
            start += k
        return out

    return theta, unflatten


def euclidean(model, batch):
    """Loss gradient and dense Hessian (torch.autograd.functional.hessian) in the flat weights."""
    theta, unflatten = flat(model)
    x, y = batch

    def f(t):
        return F.cross_entropy(functional_call(model, unflatten(t), (x,)), y)

    with sdpa_kernel([SDPBackend.MATH]):   # the fused CPU kernel has no double backward
        grad = torch.autograd.functional.jacobian(f, theta)
        return theta, unflatten, grad, torch.autograd.functional.hessian(f, theta)


def dense_riemannian(model, batch, layout, metric):
    """Dense Riemannian Hessian on the horizontal space, from scratch in the flat weights θ:

    * metric matrix g(θ): per block head kron(I_n, M_G) ⊕ kron(I_m, M_H) with inv M = (P⁻¹, Q⁻¹),
      mix M = (Q, P) (docs/maths.md §2), diag(1/θ²) on every other weight;
    * Christoffel symbols of the first kind from jacfwd of g: Γ_{l,ij} = ½(∂_i g_lj + ∂_j g_li −
      ∂_l g_ij), and the covariant Hessian h = ∇²f − Σ_l (g⁻¹∇f)_l Γ_{l,ij};
    * vertical vectors (GE, −HEᵀ) for E in a basis of each block's Lie algebra, and a g-orthonormal
      basis B of their g-orthogonal complement (Cholesky g = LLᵀ, SVD of LᵀV);

    returns (Bᵀ h B, ∇²f)."""
    theta, unflatten, grad, hess = euclidean(model, batch)
    D = theta.numel()
    index = {n: t.to(DT) for n, t in unflatten(torch.arange(D, dtype=DT)).items()}
    heads = []  # (θ indices of x = [G; H] of one head, n, block)
    for block in (layout.blocks if layout is not None else []):
        for idx in block.gather(index).round().long():
            heads.append((idx, block.n, block))

    def metric_matrix(t):
        g = torch.zeros(D, D, dtype=t.dtype)
        covered = torch.zeros(D, dtype=torch.bool)
        for idx, n, _ in heads:
            x = t[idx.reshape(-1)].view(idx.shape)
            G, H = x[:n], x[n:]
            P, Q = G.T @ G, H.T @ H
            M_G, M_H = (torch.linalg.inv(P), torch.linalg.inv(Q)) if metric == "inv" else (Q, P)
            m = idx.shape[0] - n
            blk = torch.block_diag(torch.kron(torch.eye(n, dtype=t.dtype), M_G.contiguous()),
                                   torch.kron(torch.eye(m, dtype=t.dtype), M_H.contiguous()))
            flat_idx = idx.reshape(-1)
            g = g.index_put((flat_idx[:, None], flat_idx[None, :]), blk)
            covered[flat_idx] = True
        return g + torch.diag(torch.where(covered, torch.zeros_like(t), 1 / t ** 2))

    g0 = metric_matrix(theta)
    dg = jacfwd(metric_matrix)(theta)                        # dg[k, l, m] = ∂_m g_kl
    r = torch.linalg.solve(g0, grad)
    contraction = 0.5 * (torch.einsum("l,lji->ij", r, dg) + torch.einsum("l,lij->ij", r, dg)
                         - torch.einsum("l,ijl->ij", r, dg))
    h = hess - contraction
    vertical = []
    for idx, n, block in heads:
        x = theta[idx.reshape(-1)].view(idx.shape)
        for E in block.group.algebra_basis(block.head_dim, dtype=DT):
            z = torch.zeros(D, dtype=DT)
            z[idx.reshape(-1)] = torch.cat((x[:n] @ E, -x[n:] @ E.T)).reshape(-1)
            vertical.append(z)
    L = torch.linalg.cholesky(g0)
    if vertical:
        V = torch.stack(vertical, 1)
        U, s, _ = torch.linalg.svd(L.T @ V, full_matrices=True)
        assert s.min() > 1e-8 * s.max()                    # the vertical vectors are independent
        Z = U[:, V.shape[1]:]
    else:
        Z = torch.eye(D, dtype=DT)
    B = torch.linalg.solve_triangular(L.T, Z, upper=True)  # BᵀgB = I, Bᵀ g V = 0
    return B.T @ h @ B, hess


# ------------------------------------------------------------------------------------- tests
@pytest.mark.parametrize("geometry", ["geodesic-inv", "geodesic-mix", "adaptive"])
def test_matches_dense_brute_force(geometry):
    model = tiny_attention()
    batch = tiny_batches()[0]
    layout = adapters.layout(model) if geometry != "adaptive" else None
    op = riemannian_hessian(model, [batch], geometry=geometry, layout=layout)
    R, _ = dense_riemannian(model, batch, layout, geometry.split("-")[-1])
    A = dense(op)
    assert op.shape == (95, 95)
    assert R.shape[0] == op.quotient_dim == (95 - 16 if layout else 95)   # 4 heads × dim gl(2)
    want = torch.cat((torch.linalg.eigvalsh(R), torch.zeros(95 - R.shape[0], dtype=DT))).sort().values
    got = torch.linalg.eigvalsh(A).sort().values
    scale = want.abs().max()
    assert scale > 1e-3
    assert (got - want).abs().max() < 1e-9 * scale, (got - want).abs().max()
    assert rel(float(torch.trace(A)), float(torch.trace(R))) < 1e-9
    assert rel(trace(op, method="exact"), float(torch.trace(R))) < 1e-9
    assert torch.allclose(top_eigenvalues(op, 3), want.flip(0)[:3], rtol=1e-8, atol=0)


def test_adaptive_closed_form():
    """geometry='adaptive': A = D_|w| ∇²f D_|w| + diag(w ⊙ ∇f) (module docstring)."""
    model = tiny_attention()
    batch = tiny_batches()[0]
    theta, _, grad, hess = euclidean(model, batch)
    op = riemannian_hessian(model, [batch], geometry="adaptive")
    want = theta.abs()[:, None] * hess * theta.abs()[None, :] + torch.diag(theta * grad)
    assert torch.allclose(dense(op), want, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("geometry", ["geodesic-inv", "geodesic-mix"])
def test_trace_and_top_eigenvalue_invariant_under_gl_reparametrisation(geometry):
    model = tiny_attention()
    batch = tiny_batches()[0]
    layout = adapters.layout(model)
    riem, eucl = [], []
    for scale in (1.0, 0.1, 10.0):
        m = model if scale == 1.0 else reparametrised_copy(model, layout=layout, scale=scale, cond=1e2,
                                                           seed=int(scale * 10))
        op = riemannian_hessian(m, [batch], geometry=geometry, layout=layout)
        riem.append((trace(op, method="exact"), float(top_eigenvalues(op, 1)[0])))
        H = euclidean(m, batch)[3]
        eucl.append((float(torch.trace(H)), float(torch.linalg.eigvalsh(H)[-1])))
    for (tr, lam), (tr0, lam0) in zip(riem[1:], riem[:1] * 2):
        assert rel(tr, tr0) < 1e-6 and rel(lam, lam0) < 1e-6, (riem, geometry)
    ratios = [(tr / eucl[0][0], lam / eucl[0][1]) for tr, lam in eucl[1:]]
    print(f"\n{geometry}: Riemannian (trace, λ_max) {riem}; Euclidean ratios after the action "
          f"(trace, λ_max) {ratios}")
    assert all(abs(a - 1) > 0.1 and abs(b - 1) > 0.1 for a, b in ratios), ratios


def test_adaptive_is_not_gl_invariant():
    """The contrast: the elementwise metric is not GL-invariant, nor is its Hessian trace."""
    model = tiny_attention()
    batch = tiny_batches()[0]
    layout = adapters.layout(model)
    tr0 = trace(riemannian_hessian(model, [batch], geometry="adaptive"), method="exact")
    acted = reparametrised_copy(model, layout=layout, scale=1.0, cond=1e2)
    tr1 = trace(riemannian_hessian(acted, [batch], geometry="adaptive"), method="exact")
    assert rel(tr0, tr1) > 0.05


@pytest.mark.parametrize("geometry", ["geodesic-inv", "geodesic-mix", "adaptive"])
def test_symmetric(geometry):
    model = tiny_attention()
    op = riemannian_hessian(model, tiny_batches((4, 3)), geometry=geometry)
    g = torch.Generator().manual_seed(3)
    v, w = (torch.randn(op.shape[0], generator=g, dtype=DT) for _ in range(2))
    Av, Aw = op @ v, op @ w
    assert abs(float(v @ Aw - Av @ w)) < 1e-12 * float(Av.norm() * w.norm())
    assert float(Av.norm()) > 1e-3


def test_vertical_directions_are_exact_zeros():
    model = tiny_attention()
    op = riemannian_hessian(model, tiny_batches(), geometry="geodesic-inv")
    A = dense(op)
    vals = torch.linalg.eigvalsh(A)
    assert int((vals.abs() < 1e-12 * vals.abs().max()).sum()) >= op.shape[0] - op.quotient_dim
    for c, eta in zip(op.components, _vertical_eta(op, torch.Generator().manual_seed(0))):
        if eta is not None:
            assert float((op @ eta).norm()) < 1e-12 * float(A.norm() * eta.norm())


def _inverse_sqrt(N):
    lam, V = torch.linalg.eigh(N)
    return (V / lam.sqrt()[..., None, :]) @ V.mT


def _vertical_eta(op, gen, *, basis=None):
    """Per quotient component, the full coordinate vector η = S⁻¹(GΛ, −HΛᵀ) (S⁻¹ = N^{-1/2}, zero
    on the other components) of a random vertical vector with Λ in the span of ``basis`` (default:
    the component's Lie algebra); None for the elementwise component."""
    out = []
    sizes = [c.x0.numel() for c in op.components]
    for i, c in enumerate(op.components):
        if not isinstance(c, QuotientComponent):
            out.append(None)
            continue
        frame, h = c.frame, c.x0.shape[-1]
        E = basis if basis is not None else frame.geometry.group.algebra_basis(h, dtype=DT)
        lam = torch.einsum("ba,aij->bij", torch.randn(c.x0.shape[0], E.shape[0], generator=gen,
                                                       dtype=DT), E)
        z = frame.vertical(lam)
        n = frame.geometry.n
        N_G, N_H = frame.inverse_metric_weights
        eta = torch.cat((z[:, :n] @ _inverse_sqrt(N_G), z[:, n:] @ _inverse_sqrt(N_H)), 1)
        full = torch.zeros(sum(sizes), dtype=DT)
        full[sum(sizes[:i]):sum(sizes[:i + 1])] = eta.reshape(-1)
        out.append(full)
    return out


# ------------------------------------------------------------------------------- rotary block
def tiny_llama():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32,
                                   num_hidden_layers=1, num_attention_heads=2,
                                   num_key_value_heads=2, max_position_embeddings=16)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).to(DT).eval()
    ids = torch.randint(0, 32, (2, 6), generator=torch.Generator().manual_seed(2))
    return model, [{"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}]


def test_rotary_block_with_its_group():
    model, batches = tiny_llama()
    layout = adapters.layout(model)
    op = riemannian_hessian(model, batches, geometry="geodesic-mix", layout=layout)
    groups = [c.frame.geometry.group for c in op.components if isinstance(c, QuotientComponent)]
    assert any(isinstance(gr, RotaryGroup) for gr in groups)
    h, heads = 8, 2
    n_elem = sum(p.numel() for n, p in model.named_parameters() if "self_attn" not in n)
    assert op.quotient_dim == heads * (32 * h - h) + heads * (32 * h - h * h) + n_elem
    gen = torch.Generator().manual_seed(0)
    v, w = (torch.randn(op.shape[0], generator=gen, dtype=DT) for _ in range(2))
    Av, Aw = op @ v, op @ w
    # HF's RMSNorm computes in float32 even in a float64 model: roundoff ~1e-9 relative
    assert abs(float(v @ Aw - Av @ w)) < 1e-7 * float(Av.norm() * w.norm())
    # the rotary algebra is vertical (exact zeros); a GL(h) generator outside it is not
    rotary = next(i for i, gr in enumerate(groups) if isinstance(gr, RotaryGroup))
    eta = _vertical_eta(op, gen)[rotary]
    assert float((op @ eta).norm()) < 1e-10 * float(Av.norm() / v.norm() * eta.norm())
    mixing = torch.zeros(1, h, h, dtype=DT)
    mixing[0, 0, 1] = 1.0                      # pairs are (i, i + 4): e_0 e_1ᵀ mixes two pairs
    assert float(RotaryGroup().project_algebra(mixing).abs().max()) == 0
    eta_gl = _vertical_eta(op, gen, basis=mixing)[rotary]
    assert float((op @ eta_gl).norm()) > 1e-3 * float(Av.norm() / v.norm() * eta_gl.norm())
    # λ_max and λ_min invariant under the rotary group on Q/K and GL(h) on V/O
    acted = reparametrised_copy(model, layout=layout, scale=3.0, cond=10.0)
    op2 = riemannian_hessian(acted, batches, geometry="geodesic-mix", layout=layout)
    for which in ("LA", "SA"):
        a, b = float(top_eigenvalues(op, 1, which=which)[0]), float(top_eigenvalues(op2, 1, which=which)[0])
        assert rel(a, b) < 1e-6, (which, a, b)


# ------------------------------------------------------------------------- curvlinops, data
def test_curvlinops_estimators_accept_the_operator():
    import curvlinops

    model = tiny_attention()
    op = riemannian_hessian(model, tiny_batches(), geometry="geodesic-mix")
    exact = float(torch.trace(dense(op)))
    assert rel(trace(op, method="exact"), exact) < 1e-12
    torch.manual_seed(0)
    hpp = float(curvlinops.hutchpp_trace(op, 90))
    hutch = float(curvlinops.hutchinson_trace(op, 90))
    assert rel(hpp, exact) < 0.2 and np.isfinite(hutch)
    assert trace(op, method="hutch++", num_matvecs=90) == trace(op, method="hutch++", num_matvecs=90)
    assert trace(op, num_matvecs=200) == pytest.approx(exact, rel=1e-12)    # ≥ D: exact
    grid, density = curvlinops.lanczos_approximate_spectrum(op, ncv=20, num_points=200)
    lam_max = float(top_eigenvalues(op, 1)[0])
    assert grid.max() >= lam_max and float(density.sum() * (grid[1] - grid[0])) == pytest.approx(1, abs=0.05)
    assert isinstance(op, curvlinops._torch_base.PyTorchLinearOperator) and op.SELF_ADJOINT


def test_mean_over_batches_like_curvlinops():
    """Batches of 2 and 5 (mean losses) give the Hessian of the mean loss over all 7 points; a
    loss module with reduction='sum' gives the sum."""
    model = tiny_attention()
    (x, y), = tiny_batches((7,))
    split = [(x[:2], y[:2]), (x[2:], y[2:])]
    A_split = dense(riemannian_hessian(model, split, geometry="geodesic-inv"))
    A_joint = dense(riemannian_hessian(model, [(x, y)], geometry="geodesic-inv"))
    assert torch.allclose(A_split, A_joint, rtol=1e-10, atol=1e-13)
    op_sum = riemannian_hessian(model, iter(split), geometry="geodesic-inv",
                                loss_fn=nn.CrossEntropyLoss(reduction="sum"))
    assert op_sum.num_data == 7
    assert torch.allclose(dense(op_sum), 7 * A_joint, rtol=1e-10, atol=1e-12)


def test_float32_model():
    """A float32 model gives a float32 operator (Gram algebra in float64) close to the float64 one."""
    model = tiny_attention()
    batches = tiny_batches()
    op64 = riemannian_hessian(model, batches, geometry="geodesic-mix")
    op32 = riemannian_hessian(copy.deepcopy(model).float(),
                              [(x.float(), y) for x, y in batches], geometry="geodesic-mix")
    assert op32.dtype == torch.float32
    v = torch.randn(op64.shape[0], generator=torch.Generator().manual_seed(0), dtype=DT)
    a, b = op64 @ v, (op32 @ v.float()).double()
    assert float((a - b).norm()) < 1e-4 * float(a.norm())
    assert rel(float(top_eigenvalues(op32, 1)[0]), float(top_eigenvalues(op64, 1)[0])) < 1e-4


def test_model_never_modified_and_train_flags_restored():
    model = tiny_attention().train()
    model.head.eval()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    op = riemannian_hessian(model, tiny_batches(), geometry="geodesic-mix")
    op @ torch.ones(op.shape[0], dtype=DT)
    for n, p in model.named_parameters():
        assert torch.equal(p.detach(), before[n]) and p.grad is None, n
    assert model.training and model.attn.training and not model.head.training


def test_errors_are_actionable():
    model = tiny_attention()
    with pytest.raises(InvalidArgument, match="geometry"):
        riemannian_hessian(model, tiny_batches(), geometry="euclid")
    with pytest.raises(InvalidArgument, match="reduction"):
        riemannian_hessian(model, tiny_batches(), reduction="max")
    with pytest.raises(InvalidArgument, match="empty"):
        riemannian_hessian(model, [])
    op = riemannian_hessian(model, tiny_batches(), geometry="adaptive")
    with pytest.raises(InvalidArgument, match="k must be"):
        top_eigenvalues(op, 0)
    with pytest.raises(InvalidArgument, match="method must be one of"):
        trace(op, method="lanczos")
    frozen = tiny_attention().requires_grad_(False)
    with pytest.raises(InvalidArgument, match="requires_grad"):
        riemannian_hessian(frozen, tiny_batches())
    assert isinstance(op, RiemannianHessian) and "adaptive" in repr(op)


def test_adapters_imports_without_curvlinops():
    """``from quotient_manifolds import adapters`` (the README's main command) must not need the optional curvlinops; the
    Hessian names then fail on first use with the install command."""
    import subprocess
    import sys

    code = ("import sys; sys.modules['curvlinops'] = None\n"
            "from quotient_manifolds import adapters\n"
            "assert 'riemannian_hessian' not in adapters.__all__\n"
            "try:\n"
            "    adapters.riemannian_hessian\n"
            "except ImportError as err:\n"
            "    assert 'pip install --no-deps curvlinops-for-pytorch' in str(err), err\n"
            "else:\n"
            "    raise AssertionError('no ImportError')\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
