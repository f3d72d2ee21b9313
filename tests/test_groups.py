"""Subgroup quotients: the rotary commutant GL(1,C)^{r/2} x GL(h-r) beside the full GL(h).

The horizontal projection of every group is checked against a dense brute-force solve (metric
matrix assembled entry by entry, vertical space spanned by the Lie-algebra basis), and the group
structure against the rotations it must commute with."""

from __future__ import annotations

import math

import geoopt
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from _projection_checks import check_projection

from quotient_manifolds import GLQuotient
from quotient_manifolds.core import FULL_GL, METRICS, GLQuotientGeometry, RotaryGroup, as_group
from quotient_manifolds.errors import InvalidArgument

F64 = torch.float64
GROUPS = [FULL_GL, RotaryGroup(), RotaryGroup("interleaved"), RotaryGroup("half", 4),
          RotaryGroup("interleaved", 2)]
SETTINGS = settings(max_examples=25, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow])


def rope_rotation(h: int, group: RotaryGroup, theta: float) -> torch.Tensor:
    """The RoPE rotation of one head at angle θ: pair j turns by θ·base^{-2j/r}; the rest is fixed."""
    R = torch.eye(h, dtype=F64)
    r = group.rotated(h)
    for j, (p, q) in enumerate(group.pairs(h)):
        a = theta * 10000.0 ** (-2 * j / r)
        R[p, p] = R[q, q] = math.cos(a)
        R[q, p], R[p, q] = math.sin(a), -math.sin(a)
    return R


def dense_projection(geom: GLQuotientGeometry, x: torch.Tensor, u: torch.Tensor):
    """Brute force: metric matrix M (entry by entry), vertical basis V from the Lie algebra;
    P u = u − V (VᵀMV)⁻¹ VᵀM u. Returns (P u, rank of V)."""
    frame = geom.frame(x)
    V = torch.stack([frame.vertical(E).reshape(-1) for E in geom.group.algebra_basis(geom.h)], 1)
    eye = torch.eye(x.numel(), dtype=F64)
    M = torch.stack([torch.stack([frame.inner(eye[i].view_as(x), eye[j].view_as(x))
                                  for j in range(x.numel())]) for i in range(x.numel())])
    coef = torch.linalg.solve(V.T @ M @ V, V.T @ M @ u.reshape(-1))
    return (u.reshape(-1) - V @ coef).view_as(x), int(torch.linalg.matrix_rank(V))


@pytest.mark.parametrize("group", GROUPS, ids=lambda g: g.describe(6))
@pytest.mark.parametrize("metric", METRICS)
@pytest.mark.parametrize("eps", [0.0, 0.1])
def test_projection_matches_dense_solve(group, metric, eps):
    torch.manual_seed(0)
    geom = GLQuotientGeometry(7, 6, 6, metric, group=group, eps=eps)
    x = geom.random_point(dtype=F64)
    u = torch.randn_like(x)
    frame = geom.frame(x)
    p = frame.project(u)
    expected, rank = dense_projection(geom, x, u)
    assert torch.allclose(p, expected, atol=1e-10, rtol=0)
    assert rank == group.dim(6)                                     # the vertical map is injective
    assert geom.dim == (7 + 6) * 6 - group.dim(6)
    assert float((frame.project(p) - p).abs().max()) < 1e-10         # idempotent
    assert float(frame.horizontal_residual(p)) < 1e-10
    assert float(frame.horizontal_residual(u)) > 1e-2
    # metric-orthogonal to every vertical vector of the group
    for E in group.algebra_basis(6):  # relative to ‖p‖‖V‖ ~ 10 (1.1e-10 absolute seen on torch 2.11)
        V = frame.vertical(E)
        assert abs(float(frame.inner(p, V))) < 1e-11 * float(frame.norm(p) * frame.norm(V))


def test_rank_of_projection_is_quotient_dimension():
    geom = GLQuotientGeometry(5, 4, 4, "inv", group=RotaryGroup("half", 2))
    x = geom.random_point(dtype=F64, generator=torch.Generator().manual_seed(3))
    frame = geom.frame(x)
    eye = torch.eye(x.numel(), dtype=F64)
    P = torch.stack([frame.project(e.view_as(x)).reshape(-1) for e in eye], 1)
    assert int(torch.linalg.matrix_rank(P)) == geom.dim == 9 * 4 - (2 + 2 ** 2)


@pytest.mark.parametrize("group", GROUPS[1:], ids=lambda g: g.describe(6))
def test_rotary_group_is_the_commutant_of_rope(group):
    """Random group elements commute with every RoPE rotation; a generic GL element does not; and
    the Lie algebra is exactly the solution space of [Λ, R(θ)] = 0 for a generic θ."""
    h, gen = 6, torch.Generator().manual_seed(1)
    A = group.random_element(h, (5,), cond=1e3, generator=gen)
    assert group.contains(A)
    for theta in (0.3, 1.7, 11.0):
        R = rope_rotation(h, group, theta)
        assert torch.allclose(A @ R, R @ A, atol=1e-10)
    B = FULL_GL.random_element(h, (1,), generator=gen)[0]
    assert not torch.allclose(B @ R, R @ B, atol=1e-3)
    # the commutant of {R(θ)} by brute force: null space of Λ ↦ ΛR − RΛ for two angles
    rows = []
    for theta in (0.7, 2.3):
        R = rope_rotation(h, group, theta)
        rows.append(torch.kron(torch.eye(h, dtype=F64), R.T.contiguous()) - torch.kron(R, torch.eye(h, dtype=F64)))
    null_dim = h * h - int(torch.linalg.matrix_rank(torch.cat(rows)))
    assert null_dim == group.dim(h)
    basis = group.algebra_basis(h)
    assert all(torch.allclose(E @ R, R @ E, atol=1e-12) for E in basis)


@pytest.mark.parametrize("group", GROUPS, ids=lambda g: g.describe(6))
def test_random_elements_have_the_requested_condition(group):
    A = group.random_element(6, (3,), cond=1e2, scale=0.5, generator=torch.Generator().manual_seed(0))
    s = torch.linalg.svdvals(A)
    assert torch.allclose(s[:, 0] / s[:, -1], torch.full((3,), 100.0, dtype=F64), rtol=1e-8)


@pytest.mark.parametrize("group", GROUPS[1:], ids=lambda g: g.describe(6))
@pytest.mark.parametrize("metric", METRICS)
def test_projection_and_retraction_are_equivariant_under_the_group(group, metric):
    """P_{xA}(uA) = (P_x u)A and R_{xA}(ξA) = R_x(ξ)A for A in the group (the metric, Γ and the
    vertical space transform together)."""
    geom = GLQuotientGeometry(7, 6, 6, metric, group=group)
    gen = torch.Generator().manual_seed(2)
    x = geom.random_point(dtype=F64, generator=gen)
    u = torch.randn(x.shape, dtype=F64, generator=gen)
    A = group.random_element(6, cond=30.0, generator=gen)
    xA, uA = geom.act(x, A), geom.act(u, A)
    assert torch.allclose(geom.project(xA, uA), geom.act(geom.project(x, u), A), atol=1e-9)
    xi = 0.1 * geom.project(x, u)
    assert torch.allclose(geom.inner(x, xi), geom.inner(xA, geom.act(xi, A)), rtol=1e-9)
    G, H = geom.split(geom.retract(x, xi))
    G2, H2 = geom.split(geom.retract(xA, geom.act(xi, A)))
    assert torch.allclose(G @ H.mT, G2 @ H2.mT, atol=1e-9)


def test_projection_handles_batches_and_float32():
    geom = GLQuotientGeometry(9, 8, 8, "mix", group=RotaryGroup("half", 4))
    x = geom.random_point(3, 2, dtype=torch.float32, generator=torch.Generator().manual_seed(0))
    u = torch.randn_like(x)
    p = geom.project(x, u)
    assert p.dtype == torch.float32 and p.shape == x.shape
    single = geom.project(x[1, 0].double(), u[1, 0].double())
    assert torch.allclose(p[1, 0].double(), single, atol=1e-5)


@st.composite
def subgroup_problems(draw):
    pairs = draw(st.integers(1, 3))
    free = draw(st.integers(0, 2))
    h = 2 * pairs + free
    group = RotaryGroup(draw(st.sampled_from(["half", "interleaved"])), 2 * pairs)
    n, m = draw(st.integers(h, 8)), draw(st.integers(h, 8))
    geom = GLQuotientGeometry(n, m, h, draw(st.sampled_from(METRICS)), group=group,
                              eps=draw(st.sampled_from([0.0, 1e-2])))
    return geom, draw(st.integers(0, 2 ** 31 - 1))


@SETTINGS
@given(subgroup_problems())
def test_property_projection_idempotent_and_orthogonal(problem):
    geom, seed = problem
    gen = torch.Generator().manual_seed(seed)
    x = geom.random_point(2, dtype=F64, generator=gen)
    u = torch.randn(x.shape, dtype=F64, generator=gen)
    frame = geom.frame(x)
    p = check_projection(frame, u)
    scale = float(u.abs().max())
    lam = frame.vertical_generator(u)
    assert geom.group.contains(lam, rtol=1e-12)
    assert torch.allclose(frame.vertical(lam), u - p, atol=1e-8 * scale)


def test_group_validation_errors():
    with pytest.raises(InvalidArgument, match="positive even integer"):
        RotaryGroup(rotary_dim=3)
    with pytest.raises(InvalidArgument, match="unknown rotary pairing"):
        RotaryGroup("adjacent")
    with pytest.raises(InvalidArgument, match="does not fit a head"):
        GLQuotientGeometry(8, 8, 4, group=RotaryGroup(rotary_dim=6))
    with pytest.raises(InvalidArgument, match="unknown group"):
        as_group("so")
    geom = GLQuotientGeometry(5, 5, 4, group="rope")
    with pytest.raises(InvalidArgument, match="full GL"):
        geom.balance(geom.random_point(dtype=F64))
    assert as_group("rope") == RotaryGroup() and as_group(None) is FULL_GL


def test_geoopt_rsgd_is_equivariant_on_the_rotary_quotient():
    """A loss that sees Q/K only through RoPE scores, f = Σ_θ ‖G R(θ) Hᵀ − T_θ‖², is invariant
    under the rotary group; RiemannianSGD started from x and from xA (A in the group) must produce
    the same scores after each step, and its iterates stay on their horizontal lifts."""
    group, h = RotaryGroup("half"), 4
    M = GLQuotient(9, 8, h, metric="inv", group=group)
    gen = torch.Generator().manual_seed(0)
    x0 = M.random(dtype=F64, generator=gen)
    targets = [torch.randn(9, 8, dtype=F64, generator=gen) for _ in range(3)]
    rotations = [rope_rotation(h, group, t) for t in (0.4, 1.3, 2.9)]
    A = group.random_element(h, cond=20.0, generator=gen)

    def run(start):
        x = geoopt.ManifoldParameter(start.clone(), manifold=M)
        opt = geoopt.optim.RiemannianSGD([x], lr=0.02)
        scores = []
        for _ in range(5):
            opt.zero_grad()
            G, H = M.split(x)
            loss = sum(((G @ R @ H.T - T) ** 2).sum() for R, T in zip(rotations, targets))
            loss.backward()
            opt.step()
            G, H = M.split(x.detach())
            scores.append(torch.stack([G @ R @ H.T for R in rotations]))
        return scores

    for a, b in zip(run(x0), run(M.geometry.act(x0, A))):
        assert torch.allclose(a, b, atol=1e-8)


def test_pymanopt_face_takes_the_group():
    from quotient_manifolds.pymanopt import GLQuotient as PymanoptGLQuotient

    M = PymanoptGLQuotient(7, 6, 4, metric="mix", group="rope")
    assert M.dim == 13 * 4 - 4
    np.random.seed(0)
    x = M.random_point()
    u = M.random_tangent_vector(x)
    p = M.projection(x, u)
    frame = M.geometry.frame(M._t(x))
    assert float(frame.horizontal_residual(M._t(p))) < 1e-10
