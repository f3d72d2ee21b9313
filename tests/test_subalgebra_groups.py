"""Groups given by a Lie subalgebra of gl(h), the closed forms of normalised attention, and the
numerical derivation and recognition of a block's symmetry algebra.

Projections are checked against a dense brute-force solve (the vertical space vectorised, the
metric assembled as a Kronecker matrix, the metric-orthogonal complement by dense least squares);
derivations against closures written here independently, with the expected algebra worked out by
hand."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from _projection_checks import check_projection

from quotient_manifolds.core import (
    FULL_GL,
    METRICS,
    GLQuotientGeometry,
    OrthogonalGroup,
    RotaryGroup,
    ScalarGroup,
    ScaledOrthogonalGroup,
    SubalgebraGroup,
    TrivialGroup,
    as_group,
    derive_algebra,
    recognise_algebra,
)
from quotient_manifolds.core.subalgebra import (
    ConjugateGradientSolver,
    NormalEquationsSolver,
    closure_residual,
)
from quotient_manifolds.errors import InvalidArgument

F64 = torch.float64
H6 = 6


def borel_basis(h: int, blocks=(2, 4)) -> torch.Tensor:
    """Block upper-triangular matrices (blocks of the given sizes on the diagonal, everything above
    them free): a Lie subalgebra (a parabolic), conjugated by a fixed random invertible matrix so
    that no coordinate structure is left to exploit."""
    starts = [sum(blocks[:i]) for i in range(len(blocks))]
    block_of = [i for i, b in enumerate(blocks) for _ in range(b)]
    els = []
    for i in range(h):
        for j in range(h):
            if block_of[i] <= block_of[j]:
                E = torch.zeros(h, h, dtype=F64)
                E[i, j] = 1
                els.append(E)
    P = torch.randn(h, h, dtype=F64, generator=torch.Generator().manual_seed(5)) + 3 * torch.eye(h, dtype=F64)
    Pinv = torch.linalg.inv(P)
    assert starts[-1] < h
    return torch.stack([P @ E @ Pinv for E in els])


CLOSED_FORMS = [TrivialGroup(), ScalarGroup(), OrthogonalGroup(), ScaledOrthogonalGroup()]
FROM_BASES = [SubalgebraGroup(g.algebra_basis(H6), label=g.describe(H6))
              for g in (FULL_GL, RotaryGroup("half", 4), RotaryGroup("interleaved"), ScalarGroup(),
                        OrthogonalGroup(), ScaledOrthogonalGroup())]
BOREL = SubalgebraGroup(borel_basis(H6), label="parabolic")
SO_BY_CG = SubalgebraGroup(OrthogonalGroup().algebra_basis(H6), label="so by CG", dense_max_dim=1)
BOREL_BY_CG = SubalgebraGroup(borel_basis(H6), label="parabolic by CG", dense_max_dim=1)
ALL_GROUPS = CLOSED_FORMS + FROM_BASES + [BOREL, SO_BY_CG, BOREL_BY_CG]


def group_id(g) -> str:
    return g.describe(H6)


def dense_projection(geom: GLQuotientGeometry, x: torch.Tensor, u: torch.Tensor):
    """P u = u − V c with c the dense least-squares solution of min ‖M^{1/2}(u − V c)‖ (V: the
    vectorised vertical vectors (GE, −HEᵀ) of a basis E of 𝔤, M: the metric as a Kronecker matrix)."""
    frame = geom.frame(x)
    M_G, M_H = (w.contiguous() for w in frame.metric_weights)
    M = torch.block_diag(torch.kron(torch.eye(geom.n, dtype=F64), M_G),
                         torch.kron(torch.eye(geom.m, dtype=F64), M_H))
    basis = geom.group.algebra_basis(geom.h)
    if basis.shape[0] == 0:
        return u.clone(), 0
    V = torch.stack([frame.vertical(E).reshape(-1) for E in basis], 1)
    root = torch.linalg.cholesky(M).mT
    coef = torch.linalg.lstsq(root @ V, root @ u.reshape(-1, 1)).solution[:, 0]
    return (u.reshape(-1) - V @ coef).reshape(x.shape), int(torch.linalg.matrix_rank(V))


@pytest.mark.parametrize("group", ALL_GROUPS, ids=group_id)
@pytest.mark.parametrize("metric", METRICS)
@pytest.mark.parametrize("eps", [0.0, 0.1])
def test_projection_matches_dense_solve(group, metric, eps):
    geom = GLQuotientGeometry(8, 7, H6, metric, group=group, eps=eps)
    gen = torch.Generator().manual_seed(0)
    x = geom.random_point(dtype=F64, generator=gen)
    u = torch.randn(x.shape, dtype=F64, generator=gen)
    frame = geom.frame(x)
    p = frame.project(u)
    expected, rank = dense_projection(geom, x, u)
    assert torch.allclose(p, expected, atol=1e-9, rtol=0)
    assert rank == group.dim(H6)
    assert geom.dim == (8 + 7) * H6 - group.dim(H6)
    assert float((frame.project(p) - p).abs().max()) < 1e-10           # idempotent
    for E in group.algebra_basis(H6):                                    # metric-orthogonal to V_x
        V = frame.vertical(E)
        assert abs(float(frame.inner(p, V))) < 1e-10 * float(frame.norm(p) * frame.norm(V))
    if group.dim(H6):
        assert float(frame.horizontal_residual(u)) > 1e-3


@pytest.mark.parametrize("group", [ScalarGroup(), OrthogonalGroup(), BOREL], ids=group_id)
def test_rank_of_projection_is_quotient_dimension(group):
    geom = GLQuotientGeometry(6, 6, H6, "inv", group=group, eps=0.05)
    x = geom.random_point(dtype=F64, generator=torch.Generator().manual_seed(3))
    frame = geom.frame(x)
    eye = torch.eye(x.numel(), dtype=F64)
    P = torch.stack([frame.project(e.view_as(x)).reshape(-1) for e in eye], 1)
    # rtol: conjugate gradients (so(h)) solve to a relative residual of 1e-13, so P is linear to
    # that accuracy only; a wrong dimension would leave singular values of order one
    s = torch.linalg.svdvals(P)
    assert int((s > 1e-9 * s[0]).sum()) == geom.dim == 12 * H6 - group.dim(H6)


@pytest.mark.parametrize("closed", [FULL_GL, RotaryGroup("half", 4), RotaryGroup("interleaved"),
                                    ScalarGroup(), OrthogonalGroup(), ScaledOrthogonalGroup(),
                                    TrivialGroup()], ids=group_id)
@pytest.mark.parametrize("metric", METRICS)
def test_subalgebra_group_of_a_closed_form_agrees_with_it(closed, metric):
    derived = SubalgebraGroup(closed.algebra_basis(H6))
    gen = torch.Generator().manual_seed(1)
    geom_c = GLQuotientGeometry(8, 7, H6, metric, group=closed, eps=0.01)
    geom_d = GLQuotientGeometry(8, 7, H6, metric, group=derived, eps=0.01)
    x = geom_c.random_point(3, dtype=F64, generator=gen)
    u = torch.randn(x.shape, dtype=F64, generator=gen)
    assert torch.allclose(geom_c.project(x, u), geom_d.project(x, u), atol=1e-10, rtol=0)
    X = torch.randn(4, H6, H6, dtype=F64, generator=gen)
    assert torch.allclose(closed.project_algebra(X), derived.project_algebra(X), atol=1e-12)
    assert derived.dim(H6) == closed.dim(H6) and derived.is_full == closed.is_full
    assert derived.has_scalars == closed.has_scalars


def test_conjugate_gradients_match_the_dense_normal_equations_batched():
    """so(h) and so(h) ⊕ R·I by CG against the dense d×d Cholesky solve over a batch of heads, both
    metrics, with and without ε; at ill-conditioned points CG hands over to the dense solve."""
    h, gen = 8, torch.Generator().manual_seed(2)
    for group in (OrthogonalGroup(), ScaledOrthogonalGroup()):
        for metric in METRICS:
            for eps in (0.0, 1e-3):
                for cond in (None, 300.0):
                    geom = GLQuotientGeometry(12, 10, h, metric, group=group, eps=eps)
                    x = geom.random_point(4, dtype=F64, generator=gen)
                    if cond is not None:
                        x = geom.act(x, FULL_GL.random_element(h, (4,), cond=cond, generator=gen))
                    frame = geom.frame(x)
                    C = torch.randn(2, 4, h, h, dtype=F64, generator=gen)
                    dense = NormalEquationsSolver(group.algebra_basis(h), frame)
                    cg = ConjugateGradientSolver(group.project_algebra, group.dim(h), frame,
                                                 fallback=lambda: dense)
                    lam_cg, lam_dense = cg.solve(C), dense.solve(C)
                    scale = float(lam_dense.abs().max())
                    assert float((lam_cg - lam_dense).abs().max()) <= 1e-9 * scale
                    assert torch.allclose(group.project_algebra(lam_cg), lam_cg, atol=1e-14 * scale)
                    if cond is None:
                        assert not cg.used_fallback and cg.iterations < 3 * group.dim(h)
    # the closed forms' own solvers (pencil preconditioners) converge fast even at cond 300
    for group in (OrthogonalGroup(), ScaledOrthogonalGroup()):
        for metric, eps in (("inv", 0.0), ("inv", 1e-3), ("mix", 1e-3)):
            geom = GLQuotientGeometry(12, 10, h, metric, group=group, eps=eps)
            x = geom.act(geom.random_point(4, dtype=F64, generator=gen),
                         FULL_GL.random_element(h, (4,), cond=300.0, generator=gen))
            frame = geom.frame(x)
            C = torch.randn(4, h, h, dtype=F64, generator=gen)
            solver = frame._vertical_solver
            lam = solver.solve(C)
            dense = NormalEquationsSolver(group.algebra_basis(h), frame).solve(C)
            assert not solver.used_fallback and solver.iterations <= 60
            assert float((lam - dense).abs().max()) <= 1e-9 * float(dense.abs().max())
    # the closed form's structured normal matrix agrees with the generic assembly
    geom = GLQuotientGeometry(12, 10, h, "inv", group=ScaledOrthogonalGroup(), eps=0.1)
    frame = geom.frame(geom.random_point(3, dtype=F64, generator=gen))
    C = torch.randn(3, h, h, dtype=F64, generator=gen)
    generic = NormalEquationsSolver(ScaledOrthogonalGroup().algebra_basis(h), frame)
    assert torch.allclose(frame._vertical_solver.solve(C), generic.solve(C), atol=1e-12)


def test_as_group_and_equality_by_span():
    so = OrthogonalGroup().algebra_basis(4)
    coef = torch.randn(6, 6, dtype=F64, generator=torch.Generator().manual_seed(0))
    mixed = torch.einsum("ab,bhk->ahk", coef, so)
    a, b = SubalgebraGroup(so), SubalgebraGroup(mixed, label="other")
    assert a == b and hash(a) == hash(b) and as_group(a) is a
    assert a != SubalgebraGroup(ScaledOrthogonalGroup().algebra_basis(4))
    assert len({a, b}) == 1
    with pytest.raises(AttributeError):
        a.label = "x"
    with pytest.raises(InvalidArgument, match="does not act on heads"):
        GLQuotientGeometry(8, 8, 5, group=a)
    E = torch.zeros(2, 4, 4, dtype=F64)
    E[0, 0, 1] = E[1, 1, 2] = 1.0           # [E01, E12] = E02 is not in the span
    with pytest.raises(InvalidArgument, match="not closed under the commutator"):
        SubalgebraGroup(E)


@pytest.mark.parametrize("group", ALL_GROUPS, ids=group_id)
def test_random_elements_lie_in_the_group_and_generic_matrices_do_not(group):
    gen = torch.Generator().manual_seed(4)
    A = group.random_element(H6, (3,), cond=50.0, generator=gen)
    assert A.shape == (3, H6, H6)
    assert group.contains(A)
    if not group.is_full:
        assert not group.contains(FULL_GL.random_element(H6, (1,), cond=50.0, generator=gen))
    if group.has_scalars:
        assert group.contains(group.random_element(H6, (2,), scale=10.0, generator=gen))
    else:
        with pytest.raises(InvalidArgument, match="scale=1.0"):
            group.random_element(H6, scale=2.0)


@pytest.mark.parametrize("group", [FROM_BASES[0], BOREL], ids=group_id)
def test_random_subalgebra_elements_reach_the_requested_condition(group):
    A = group.random_element(H6, (4,), cond=100.0, generator=torch.Generator().manual_seed(0))
    s = torch.linalg.svdvals(A)
    # non-compact algebras reach the target unless the principal-log strip caps t first
    ratio = s[:, 0] / s[:, -1]
    assert bool((ratio <= 100.0 * (1 + 1e-8)).all()) and float(ratio.max()) > 10.0


def test_closure_residual_detects_a_non_algebra():
    so = OrthogonalGroup().algebra_basis(5)
    assert closure_residual(so) < 1e-14
    E = torch.zeros(2, 3, 3, dtype=F64)
    E[0, 0, 1] = E[1, 1, 2] = 1.0           # [E01, E12] = E02 is not in the span
    assert closure_residual(E) > 1e-2


# ---------------------------------------------------------------------------------- derivation
H = 6
N_TOK = 16


def _data(seed=0, h=H, n_tok=N_TOK):
    gen = torch.Generator().manual_seed(seed)
    X = torch.randn(n_tok, 10, dtype=F64, generator=gen)
    Y = torch.randn(n_tok, 9, dtype=F64, generator=gen)
    G = torch.randn(10, h, dtype=F64, generator=gen)
    Hf = torch.randn(9, h, dtype=F64, generator=gen)
    return gen, X, Y, G, Hf


def rope_matrix(h: int, pos: float, pairing: str, r: int) -> torch.Tensor:
    R = torch.eye(h, dtype=F64)
    for j in range(r // 2):
        p, q = (j, j + r // 2) if pairing == "half" else (2 * j, 2 * j + 1)
        a = pos * 10000.0 ** (-2 * j / r)
        R[p, p] = R[q, q] = math.cos(a)
        R[q, p], R[p, q] = math.sin(a), -math.sin(a)
    return R


def assert_span(derivation, group, h=H):
    assert derivation.closed and derivation.gap > 1e6
    assert derivation.dim == group.dim(h)
    B = derivation.basis
    assert B.shape[0] == 0 or float((B - group.project_algebra(B)).abs().max()) < 1e-7
    assert same_algebra(recognise_algebra(derivation, h), group, h)


def same_algebra(a, b, h) -> bool:
    """Equal Lie algebras (e.g. RotaryGroup('half', 2) and RotaryGroup('interleaved', 2) are one
    group: both turn the pair (0, 1)); the closed form itself where possible."""
    return a == b or SubalgebraGroup(a.algebra_basis(h)) == SubalgebraGroup(b.algebra_basis(h))


def test_derive_bilinear_scores_is_full_gl():
    _, X, Y, G, Hf = _data()
    d = derive_algebra(lambda g, hh: (X @ g) @ (Y @ hh).T, G, Hf)
    assert_span(d, FULL_GL)
    assert d.dim == H * H and d.outputs == N_TOK ** 2


@pytest.mark.parametrize("pairing,r", [("half", H), ("interleaved", H), ("half", 4), ("interleaved", 2)])
def test_derive_rope_scores_gives_the_rotary_commutant(pairing, r):
    _, X, Y, G, Hf = _data(1)
    rotations = [rope_matrix(H, p, pairing, r) for p in (1.0, 2.0, 5.0)]

    def scores(g, hh):
        q, k = X @ g, Y @ hh
        return torch.stack([q @ R @ k.T for R in rotations])

    d = derive_algebra(scores, G, Hf)
    assert_span(d, RotaryGroup(pairing, None if r == H else r))
    assert d.dim == r + (H - r) ** 2


def normalised_scores(X, Y):
    """Scores of L2-normalised queries and keys, as a function of (G, H)."""
    def scores(g, hh):
        q, k = X @ g, Y @ hh
        return (q / q.norm(dim=-1, keepdim=True)) @ (k / k.norm(dim=-1, keepdim=True)).T
    return scores


def test_derive_normalised_q_and_k_gives_scaled_rotations():
    _, X, Y, G, Hf = _data(2)
    d = derive_algebra(normalised_scores(X, Y), G, Hf)
    assert_span(d, ScaledOrthogonalGroup())
    assert d.dim == H * (H - 1) // 2 + 1


def test_derive_normalised_head_output_mixed_by_h_gives_rotations():
    """V/O: each head's output v = x G normalised, then mixed by Hᵀ: (GQ, HQ) keeps it for Q ∈ SO(h)
    only (a scale of G is undone by the normalisation but H's inverse scale is not)."""
    _, X, _, G, Hf = _data(3, n_tok=30)    # out_t changes by (v̂_t sym(Λ) v̂_tᵀ) v̂_t Hᵀ: ≥ 21 tokens

    def out(g, hh):
        v = X @ g
        return (v / v.norm(dim=-1, keepdim=True)) @ hh.T

    d = derive_algebra(out, G, Hf)
    assert_span(d, OrthogonalGroup())
    assert d.dim == H * (H - 1) // 2


def test_derive_rms_norm_with_a_generic_gain_gives_scalars():
    """QK-norm: q ↦ w ⊙ q / rms(q) (eps = 0) with a generic learned gain w, same for k, so the
    scores are q̂ diag(w²) k̂ᵀ with q̂ = q/rms(q). By hand: a scale s of G against 1/s of H is undone
    by the normalisation (R·I ⊆ 𝔤); the norms of q and k must keep a common ratio for every input,
    which leaves Λ = λI + S with S antisymmetric; then q̂ ↦ q̂e^{S}, k̂ ↦ k̂e^{S} and the scores become
    q̂ e^{S} diag(w²) e^{−S} k̂ᵀ, unchanged iff S commutes with diag(w²), i.e. S = 0 for pairwise
    distinct w_i². So 𝔤 = R·I, dimension 1."""
    gen, X, Y, G, Hf = _data(4)
    w = 0.5 + torch.rand(H, dtype=F64, generator=gen)

    def rms(v):
        return w * v / v.pow(2).mean(-1, keepdim=True).sqrt()

    d = derive_algebra(lambda g, hh: rms(X @ g) @ rms(Y @ hh).T, G, Hf)
    assert_span(d, ScalarGroup())
    assert d.dim == 1


def test_derive_score_with_an_independent_bias_is_full_gl():
    gen, X, Y, G, Hf = _data(5)
    bias = torch.randn(N_TOK, N_TOK, dtype=F64, generator=gen)
    d = derive_algebra(lambda g, hh: torch.softmax((X @ g) @ (Y @ hh).T + bias, -1), G, Hf)
    assert_span(d, FULL_GL)


def test_derive_disentangled_content_and_position_scores_is_full_gl():
    """DeBERTa-like: G stacks a content and a positional query projection, H a content and a
    positional key projection; every score term pairs a query-side with a key-side projection, so
    (G A, H A⁻ᵀ) on both stacks together is exact."""
    gen, X, Y, _, _ = _data(6)
    P = torch.randn(N_TOK, 7, dtype=F64, generator=gen)           # relative-position embeddings
    G = torch.randn(10 + 7, H, dtype=F64, generator=gen)            # [W_q; W_q,pos]
    Hf = torch.randn(9 + 7, H, dtype=F64, generator=gen)            # [W_k; W_k,pos]

    def scores(g, hh):
        qc, qp = X @ g[:10], P @ g[10:]
        kc, kp = Y @ hh[:9], P @ hh[9:]
        return qc @ kc.T + qc @ kp.T + qp @ kc.T

    assert_span(derive_algebra(scores, G, Hf), FULL_GL)


def test_derive_a_term_on_one_projection_shrinks_the_algebra():
    """Adding q ⊙ c · 1 (a fixed vector c against q alone) keeps only the Λ with Λ c = 0 — the
    transformations fixing c: (G A, H A⁻ᵀ) changes q·c to q A c. Algebra {Λ : Λc = 0}, dimension
    h² − h, not a closed form."""
    gen, X, Y, G, Hf = _data(7)
    c = torch.randn(H, dtype=F64, generator=gen)
    d = derive_algebra(lambda g, hh: (X @ g) @ (Y @ hh).T + ((X @ g) @ c)[:, None], G, Hf)
    assert d.closed and d.gap > 1e6 and d.dim == H * H - H
    assert float((d.basis @ c).abs().max()) < 1e-9
    group = recognise_algebra(d, H)
    assert isinstance(group, SubalgebraGroup) and group.dim(H) == H * H - H


def test_derivation_needs_enough_outputs():
    _, X, Y, G, Hf = _data()
    with pytest.raises(InvalidArgument, match="cannot decide"):
        derive_algebra(lambda g, hh: (X[:3] @ g) @ (Y[:3] @ hh).T, G, Hf)


def test_derivation_without_vmap_agrees():
    _, X, Y, G, Hf = _data(8)
    scores = normalised_scores(X, Y)
    a = derive_algebra(scores, G, Hf)
    b = derive_algebra(scores, G, Hf, vectorize=False, chunk=7)
    assert a.dim == b.dim and recognise_algebra(a, H) == recognise_algebra(b, H)
    assert torch.allclose(a.singular_values, b.singular_values, atol=1e-10)


# ---------------------------------------------------------------------------------- recognition
@pytest.mark.parametrize("group", [FULL_GL, TrivialGroup(), ScalarGroup(), OrthogonalGroup(),
                                   ScaledOrthogonalGroup(), RotaryGroup("half"), RotaryGroup("interleaved"),
                                   RotaryGroup("half", 4), RotaryGroup("interleaved", 2)], ids=group_id)
def test_recognise_round_trips(group):
    basis = group.algebra_basis(H6)
    mixed = torch.einsum("ab,bhk->ahk", torch.randn(basis.shape[0], basis.shape[0], dtype=F64,
                                                    generator=torch.Generator().manual_seed(1)), basis)
    found = recognise_algebra(mixed, H6)
    assert type(found) is type(group) and same_algebra(found, group, H6)


def test_recognise_compares_spans_not_dimensions():
    # so(h) conjugated by a non-orthogonal matrix: a Lie algebra of dimension h(h−1)/2, not so(h)
    P = (torch.randn(H6, H6, dtype=F64, generator=torch.Generator().manual_seed(2))
         + 2 * torch.eye(H6, dtype=F64))
    conj = P @ OrthogonalGroup().algebra_basis(H6) @ torch.linalg.inv(P)
    g = recognise_algebra(conj, H6)
    assert isinstance(g, SubalgebraGroup) and g.dim(H6) == H6 * (H6 - 1) // 2
    # the rotary algebra of one pairing is not the other's
    assert recognise_algebra(RotaryGroup("half", 4).algebra_basis(H6), H6) == RotaryGroup("half", 4)
    assert recognise_algebra(BOREL.algebra_basis(H6), H6) == BOREL


# ---------------------------------------------------------------------------------- properties
SETTINGS = settings(max_examples=20, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow])


@st.composite
def problems(draw):
    h = draw(st.integers(2, 5))
    group = draw(st.sampled_from([ScalarGroup(), OrthogonalGroup(), ScaledOrthogonalGroup(),
                                  TrivialGroup(), "parabolic"]))
    if group == "parabolic":
        group = SubalgebraGroup(borel_basis(h, (1, h - 1)))
    n, m = draw(st.integers(h, 7)), draw(st.integers(h, 7))
    geom = GLQuotientGeometry(n, m, h, draw(st.sampled_from(METRICS)), group=group,
                              eps=draw(st.sampled_from([0.0, 1e-2])))
    return geom, draw(st.integers(0, 2 ** 31 - 1))


@SETTINGS
@given(problems())
def test_property_projection_idempotent_orthogonal_and_equivariant(problem):
    geom, seed = problem
    gen = torch.Generator().manual_seed(seed)
    x = geom.random_point(2, dtype=F64, generator=gen)
    u = torch.randn(x.shape, dtype=F64, generator=gen)
    frame = geom.frame(x)
    p = check_projection(frame, u)
    scale = float(u.abs().max())
    lam = frame.vertical_generator(u)
    assert torch.allclose(geom.group.project_algebra(lam), lam, atol=1e-10 * scale)
    if geom.eps:        # the ε-relaxed metric is not invariant, so equivariance holds for ε = 0 only
        return
    A = geom.group.random_element(geom.h, cond=10.0, generator=gen)
    assert torch.allclose(geom.project(geom.act(x, A), geom.act(u, A)), geom.act(p, A), atol=1e-7 * scale)


# ------------------------------------------------------------------------------ derive_group
def test_derive_group_screens_closed_forms_with_few_directional_derivatives():
    """Normalised scores q̂ k̂ᵀ: R₊·SO(h) found by screening and certified by one direction of
    sym₀(h), with far fewer than h² directional derivatives; plain scores: GL(h) with a handful."""
    import torch.nn.functional as F

    from quotient_manifolds.core.algebra import derive_group

    h = 12
    gen = torch.Generator().manual_seed(0)
    X, Y = (torch.randn(30, 2 * h, dtype=torch.float64, generator=gen) for _ in range(2))
    G, H = (torch.randn(2 * h, h, dtype=torch.float64, generator=gen) for _ in range(2))
    d = derive_group(lambda g, k: F.normalize(X @ g, dim=-1) @ F.normalize(Y @ k, dim=-1).T, G, H)
    assert isinstance(d.group, ScaledOrthogonalGroup) and d.method == "screened" and d.gap > 1e8
    assert d.evaluations == 4 + 2 * (3 * h + 4) + 1 < h * h           # screen + one certificate
    d = derive_group(lambda g, k: X @ g @ k.T @ Y.T, G, H)
    assert d.group == FULL_GL and d.evaluations <= 6


def test_derive_group_falls_back_to_the_null_space_when_the_certificate_fails():
    """f = (G Hᵀ, det GᵀG) is kept exactly by |det A| = 1: 𝔤 = sl(h), not a closed form. SO(h)
    passes the screen but sym₀(h) answers zero in its certificate, so the null space is computed:
    dimension h² − 1, the traceless matrices."""
    from quotient_manifolds.core.algebra import derive_group

    h = 4
    gen = torch.Generator().manual_seed(1)
    G, H = (torch.randn(3 * h, h, dtype=torch.float64, generator=gen) for _ in range(2))
    f = lambda g, k: torch.cat(((g @ k.T).reshape(-1), torch.linalg.det(g.T @ g).reshape(1)))  # noqa: E731
    d = d0 = derive_group(f, G, H)
    assert d.method == "null space" and d.dim == h * h - 1 and isinstance(d.group, SubalgebraGroup)
    traceless = torch.randn(h, h, dtype=torch.float64, generator=gen)
    traceless -= torch.trace(traceless) / h * torch.eye(h, dtype=torch.float64)
    assert torch.allclose(d0.group.project_algebra(traceless), traceless, atol=1e-8)
    assert d.reason.startswith("SO(4) passes the screen")


def test_one_closure_tolerance():
    """The derivation and the group of a basis agree on what closed means (CLOSURE_RTOL)."""
    import inspect

    from quotient_manifolds.core.algebra import derive_algebra
    from quotient_manifolds.core.subalgebra import CLOSURE_RTOL

    assert inspect.signature(derive_algebra).parameters["closure_rtol"].default == CLOSURE_RTOL
    assert inspect.signature(SubalgebraGroup).parameters["closure_rtol"].default == CLOSURE_RTOL
