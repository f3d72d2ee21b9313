r"""Symmetry groups acting on the two-factor space: the full GL(h) and its rotary-position subgroups.

A two-factor quotient is a pair (metric, group). The total-space metrics (inv, mix) are invariant
under the whole of GL(h), hence under every subgroup; so the metric, its Christoffel map, the
retractions, the Riemannian gradient and Hessian are the same for every group. What the group
decides is the *vertical space* at x = [G; H],

    V_x = { (GΛ, −HΛᵀ) : Λ ∈ 𝔤 },        𝔤 ⊆ gl(h) the Lie algebra of the group,

and with it the horizontal projection and the dimension (n+m)h − dim 𝔤 of the quotient.

Every group implements :class:`SymmetryGroup`. Groups here are block-diagonal in a fixed basis of
R^h (the groups of normalised attention, the trivial group and the group of any Lie subalgebra
given by a basis are in :mod:`quotient_manifolds.core.subalgebra`; deriving a block's algebra
numerically is :mod:`quotient_manifolds.core.algebra`):

* :class:`GLGroup`: all of GL(h) (plain attention, GQA groups, LoRA pairs). 𝔤 = gl(h).
* :class:`RotaryGroup`: the commutant of rotary position encodings. RoPE rotates each frequency
  pair (p, q) of the query and key coordinates by an angle depending on the position, so
  score = x_Qᵀ G R(θ) Hᵀ x_K, and G A R(θ) A⁻¹ Hᵀ = G R(θ) Hᵀ for every θ iff A commutes with all
  R(θ). With pairwise distinct nonzero frequencies the commutant is GL(1, ℂ) per pair: A acts on
  (p, q) as a·I + b·J (J e_p = e_q, J e_q = −e_p; a rotation-scaling), real dimension 2 per pair.
  Coordinates that are not rotated (partial rotary, ``rotary_dim < h``) see R(θ) = I, so A may mix
  them freely among themselves; a matrix mixing a rotated and a non-rotated coordinate does not
  commute with R(θ) (R(θ) has eigenvalue 1 only on the non-rotated block), so the group is exactly
  GL(1, ℂ)^{rotary_dim/2} × GL(h − rotary_dim), block-diagonal, of dimension
  rotary_dim + (h − rotary_dim)².

The horizontal projection (docs/maths.md §3.2, generalised in §13.2). The metric-orthogonal
vertical component of u is v(Λ) with Λ ∈ 𝔤 solving

    Π_𝔤( L(Λ) ) = Π_𝔤( C ),   L(Λ) = GᵀG Λ M_G + M_H Λ HᵀH,   C = Gᵀu_G M_G − M_H u_HᵀH,

because g(u, v(E)) = ⟨E, C⟩_F and g(v(Λ), v(E)) = ⟨E, L(Λ)⟩_F for every E (Π_𝔤 is the Frobenius
projection onto 𝔤; M_G, M_H are the metric weights of :class:`~quotient_manifolds.core.gl.GLFrame`).
For 𝔤 = gl(h) this is the (generalised) Sylvester equation L(Λ) = C, solved by simultaneous
diagonalisation. For the rotary group write Λ = R(c) + ι(Λ_F): c ∈ R^{rotary_dim} the pair
coefficients (basis I_j, J_j of each pair), Λ_F the free block on the non-rotated coordinates F.
The free rows give Λ_F = S⁻¹(C_FF − [L R(c)]_FF) with S(Y) = [L(ι Y)]_FF, again a generalised
Sylvester operator (on F×F); eliminating Λ_F leaves the Schur system

    (K − ⟨V, S⁻¹V⟩) c = ⟨E, C⟩ − ⟨S⁻¹V, C_FF⟩,   K_ab = ⟨E_a, L(E_b)⟩,   V_b = [L(E_b)]_FF,

a dense rotary_dim × rotary_dim solve per head (Cholesky), set up once per point.
"""

from __future__ import annotations

import functools
import math
import numbers
from dataclasses import dataclass
from typing import Optional, Tuple, Union

import torch

from ..errors import InvalidArgument
from .products import matmul

Tensor = torch.Tensor

PAIRINGS = ("half", "interleaved")


def sym(a: Tensor) -> Tensor:
    """Symmetric part ½(A + Aᵀ) over the last two dimensions.

    Parameters
    ----------
    a:
        A tensor of shape (..., k, k).

    Returns
    -------
    Tensor
        ½(a + aᵀ), transposing the last two dimensions.

    Raises
    ------
    RuntimeError
        ``a`` is not square in its last two dimensions.

    Examples
    --------
    >>> import torch
    >>> from quotient_manifolds.core import sym
    >>> sym(torch.tensor([[1.0, 2.0], [0.0, 3.0]], dtype=torch.float64))
    tensor([[1., 1.],
            [1., 3.]], dtype=torch.float64)
    """
    return 0.5 * (a + a.mT)


#: Batches of symmetric matrices larger than this on a CUDA device are diagonalised on the CPU by
#: :func:`batched_eigh`: torch routes batched ``eigh`` to cuSOLVER's batched solver only up to
#: 32 × 32 and loops over the matrices one by one above it (pytorch/pytorch#175585).
CUDA_BATCHED_EIGH_MAX = 32


def batched_eigh(a: Tensor) -> Tuple[Tensor, Tensor]:
    """``torch.linalg.eigh(a)`` (eigenvalues ascending, orthonormal eigenvectors) for a batch of
    symmetric matrices, e.g. one h×h matrix per attention head. On a CUDA device a batch of
    matrices larger than :data:`CUDA_BATCHED_EIGH_MAX` is diagonalised on the CPU and the result
    copied back: torch loops over such matrices one by one on the device, and BERT-base's 144
    heads of 64 took 233 ms there (an H100) against 39 ms on one CPU thread. The copy waits for
    the device (one host sync). Differentiable like ``eigh`` (the copies are autograd ops)."""
    if a.is_cuda and a.dim() > 2 and a.shape[-1] > CUDA_BATCHED_EIGH_MAX:
        values, vectors = torch.linalg.eigh(a.cpu())
        return values.to(a.device), vectors.to(a.device)
    return torch.linalg.eigh(a)


def pencil_basis(F1: Tensor, A: Tensor, F2: Tensor, B2: Tensor) -> Tuple[Tensor, Tensor, Tensor]:
    r"""(W₁, W₂, D) that solve the generalised Sylvester equation A Λ B + A₂ Λ B₂ = R as

        Λ = W₁ [ (W₁ᵀ R W₂) ⊘ D ] W₂ᵀ,

    given factors F₁F₁ᵀ = A₂⁻¹ and F₂F₂ᵀ = B⁻¹ (A, A₂, B, B₂ symmetric positive definite).
    With (d₁, U₁) = eigh(F₁ᵀAF₁) and (d₂, U₂) = eigh(F₂ᵀB₂F₂): W₁ = F₁U₁, W₂ = F₂U₂ satisfy
    W₁ᵀA₂W₁ = I, W₁ᵀAW₁ = diag(d₁), W₂ᵀBW₂ = I, W₂ᵀB₂W₂ = diag(d₂), so Z = W₁⁻¹ΛW₂⁻ᵀ solves
    d₁ᵢZᵢⱼ + Zᵢⱼd₂ⱼ = (W₁ᵀRW₂)ᵢⱼ; D_ij = d₁ᵢ + d₂ⱼ.
    """
    d1, U1 = batched_eigh(sym(F1.mT @ A @ F1))
    d2, U2 = batched_eigh(sym(F2.mT @ B2 @ F2))
    return F1 @ U1, F2 @ U2, d1[..., :, None] + d2[..., None, :]


def apply_pencil(basis: Tuple[Tensor, Tensor, Tensor], R: Tensor) -> Tensor:
    """Λ = W₁ [(W₁ᵀ R W₂) ⊘ D] W₂ᵀ (see :func:`pencil_basis`); R may carry extra batch dims."""
    W1, W2, D = basis
    return matmul(matmul(W1, matmul(matmul(W1.mT, R), W2) / D), W2.mT)


def _inverse_factor(spd: Tensor) -> Tensor:
    """F with F Fᵀ = spd⁻¹: F = L⁻ᵀ for the Cholesky factor L of spd."""
    L = torch.linalg.cholesky(spd)
    eye = torch.eye(spd.shape[-1], dtype=spd.dtype, device=spd.device)
    return torch.linalg.solve_triangular(L, eye, upper=False).mT


def _haar_scaled(batch: Tuple[int, ...], k: int, cond: Optional[float], generator, dtype) -> Tensor:
    """k×k matrices U diag(s) Vᵀ, Haar U, V, s log-spaced over [cond^{-1/2}, cond^{1/2}]
    (condition number exactly ``cond``); Gaussian entries when ``cond`` is None."""
    if cond is None:
        return torch.randn(batch + (k, k), generator=generator, dtype=dtype)
    U, _ = torch.linalg.qr(torch.randn(batch + (k, k), generator=generator, dtype=dtype))
    V, _ = torch.linalg.qr(torch.randn(batch + (k, k), generator=generator, dtype=dtype))
    s = (torch.logspace(-0.5, 0.5, k, base=float(cond), dtype=dtype) if k > 1
         else torch.ones(1, dtype=dtype))
    return (U * s) @ V.mT


@dataclass(frozen=True)
class _Pairs:
    """Index structure of a block-diagonal group on R^h: rotation-scaling pairs and a free block.

    ``rows``, ``cols``, ``signs`` (each (2·pairs, 2)): basis element a of the pair part is
    Σ_t signs[a, t] e_{rows[a, t]} e_{cols[a, t]}ᵀ — I_j = e_pe_pᵀ + e_qe_qᵀ, J_j = e_qe_pᵀ − e_pe_qᵀ.
    ``free``: the coordinates of the GL block."""

    h: int
    rows: Tensor
    cols: Tensor
    signs: Tensor
    free: Tensor

    @property
    def n_coef(self) -> int:
        return self.rows.shape[0]

    def coefficients(self, X: Tensor) -> Tensor:
        """⟨E_a, X⟩_F for every pair basis element E_a: shape (..., 2·pairs)."""
        return (X[..., self.rows, self.cols] * self.signs.to(X.dtype)).sum(-1)

    def assemble(self, c: Tensor) -> Tensor:
        """R(c) = Σ_a c_a E_a as an (..., h, h) matrix."""
        h = self.h
        flat = (self.rows * h + self.cols).reshape(-1).to(c.device)
        vals = (c[..., :, None] * self.signs.to(device=c.device, dtype=c.dtype)).reshape(
            c.shape[:-1] + (2 * self.n_coef,))
        out = torch.zeros(c.shape[:-1] + (h * h,), dtype=c.dtype, device=c.device)
        return out.scatter_add(-1, flat.expand(vals.shape), vals).view(c.shape[:-1] + (h, h))


class SymmetryGroup:
    """The interface every group of the two-factor quotient implements (a connected subgroup of
    GL(h) given by its Lie algebra 𝔤 ⊆ gl(h)): the quotient needs only 𝔤 — its dimension, the
    Frobenius projection Π_𝔤 and the solver of the normal equations Π_𝔤 L(Λ) = Π_𝔤 C — plus
    random elements and a membership test for checking symmetries.

    Subclasses: :class:`GLGroup`, :class:`RotaryGroup` here, and the groups of
    :mod:`quotient_manifolds.core.subalgebra` (scalars, orthogonal, scaled orthogonal, trivial, and
    the group of any Lie subalgebra given by a basis).

    Examples
    --------
    >>> import torch
    >>> from quotient_manifolds.core import SymmetryGroup, as_group
    >>> group = as_group("gl")
    >>> isinstance(group, SymmetryGroup), group.dim(3)
    (True, 9)
    >>> A = group.random_element(3, dtype=torch.float64)
    >>> group.contains(A)
    True
    """

    def dim(self, h: int) -> int:  # pragma: no cover - overridden
        raise NotImplementedError

    def check(self, h: int) -> None:
        """Raise ValueError if the group is not defined on R^h."""

    def describe(self, h: int) -> str:  # pragma: no cover - overridden
        raise NotImplementedError

    @property
    def is_full(self) -> bool:
        """Whether the group is all of GL(h)."""
        return False

    @property
    def has_scalars(self) -> bool:
        """Whether the positive scalars R₊·I belong to the group (then ``random_element`` may be
        multiplied by any ``scale > 0`` and stay in the group)."""
        return True

    def project_algebra(self, X: Tensor) -> Tensor:  # pragma: no cover - overridden
        raise NotImplementedError

    def algebra_basis(self, h: int, *, dtype=torch.float64, device=None) -> Tensor:  # pragma: no cover
        raise NotImplementedError

    def random_element(self, h: int, batch: Tuple[int, ...] = (), *, scale: float = 1.0,
                       cond: Optional[float] = 1e2, generator=None,
                       dtype=torch.float64) -> Tensor:  # pragma: no cover - overridden
        raise NotImplementedError

    def contains(self, A: Tensor, *, rtol: float = 1e-10) -> bool:  # pragma: no cover
        raise NotImplementedError

    def vertical_solver(self, frame):  # pragma: no cover - overridden
        """An object whose ``solve(C)`` returns Λ ∈ 𝔤 with Π_𝔤 L(Λ) = Π_𝔤 C at the frame's point."""
        raise NotImplementedError


class _BlockDiagonalGroup(SymmetryGroup):
    """Shared behaviour of the block-diagonal groups (rotation-scaling pairs and a free GL block):
    algebra projection, basis, sampling, membership."""

    def structure(self, h: int, device=None) -> _Pairs:  # pragma: no cover - overridden
        raise NotImplementedError

    # ------------------------------------------------------------------ Lie algebra
    def project_algebra(self, X: Tensor) -> Tensor:
        """Frobenius-orthogonal projection Π_𝔤 of (..., h, h) matrices onto the Lie algebra."""
        st = self.structure(X.shape[-1], X.device)
        out = st.assemble(st.coefficients(X) / 2)     # ⟨E_a, E_a⟩ = 2 for I_j and J_j
        F = st.free
        if F.numel():
            out[..., F[:, None], F[None, :]] = X[..., F[:, None], F[None, :]]
        return out

    def algebra_basis(self, h: int, *, dtype=torch.float64, device=None) -> Tensor:
        """A basis of 𝔤 as a (dim 𝔤, h, h) tensor (pair elements I_j, J_j, then E_kl on F×F)."""
        st = self.structure(h, device)
        pair = st.assemble(torch.eye(st.n_coef, dtype=dtype, device=device))
        F = st.free.tolist()
        free = torch.zeros(len(F) ** 2, h, h, dtype=dtype, device=device)
        for idx, (k, l) in enumerate((k, l) for k in F for l in F):
            free[idx, k, l] = 1
        return torch.cat((pair, free), 0)

    def random_element(self, h: int, batch: Tuple[int, ...] = (), *, scale: float = 1.0,
                       cond: Optional[float] = 1e2, generator=None,
                       dtype=torch.float64) -> Tensor:
        """Random group elements (batch..., h, h) with condition number ``cond`` (Gaussian
        entries of the group's parameters when ``cond`` is None), times ``scale``.

        Rotary pairs get r·(cos φ I + sin φ J) with φ uniform and log r spread over
        [−½ log cond, ½ log cond] (extremes included), the free block a matrix of
        :func:`_haar_scaled`."""
        st = self.structure(h)
        A = torch.zeros(batch + (h, h), dtype=dtype)
        npair = st.n_coef // 2
        if npair:
            if cond is None:
                c = torch.randn(batch + (st.n_coef,), generator=generator, dtype=dtype)
            else:
                logs = torch.linspace(-0.5, 0.5, npair, dtype=dtype) * math.log(float(cond))
                if npair == 1:
                    logs = torch.zeros(1, dtype=dtype)
                perm = torch.argsort(torch.rand(batch + (npair,), generator=generator, dtype=dtype), -1)
                r = logs.exp()[perm]
                phi = 2 * math.pi * torch.rand(batch + (npair,), generator=generator, dtype=dtype)
                c = torch.stack((r * phi.cos(), r * phi.sin()), -1).reshape(batch + (st.n_coef,))
            A = A + st.assemble(c)
        F = st.free
        if F.numel():
            A[..., F[:, None], F[None, :]] = _haar_scaled(batch, F.numel(), cond, generator, dtype)
        return scale * A

    def contains(self, A: Tensor, *, rtol: float = 1e-10) -> bool:
        """Whether the (..., h, h) matrices lie in the group's block structure (up to rtol)."""
        dev = (A - self.project_algebra(A)).abs().amax()
        return bool(dev <= rtol * A.abs().amax().clamp_min(1e-300))

    # ------------------------------------------------------------------ horizontal projection
    def vertical_solver(self, frame) -> "VerticalSolver":
        """The solver of Π_𝔤 L(Λ) = Π_𝔤 C at the frame's point (set up once per point)."""
        return VerticalSolver(self, frame)


@dataclass(frozen=True)
class GLGroup(_BlockDiagonalGroup):
    """The full general linear group GL(h): (G, H) ~ (G A, H A⁻ᵀ) for every invertible A.

    The default group of every quotient (``group="gl"``); its instance is
    :data:`~quotient_manifolds.core.FULL_GL`.

    Examples
    --------
    >>> from quotient_manifolds.core import FULL_GL, GLGroup, GLQuotientGeometry
    >>> GLGroup().dim(3), GLGroup().describe(3)
    (9, 'GL(3)')
    >>> GLQuotientGeometry(4, 4, 3, group=GLGroup()).dim == (4 + 4) * 3 - 9
    True
    """

    name = "gl"

    @property
    def is_full(self) -> bool:
        return True

    def dim(self, h: int) -> int:
        return h * h

    def describe(self, h: int) -> str:
        return f"GL({h})"

    @functools.lru_cache(maxsize=64)
    def structure(self, h: int, device=None) -> _Pairs:
        empty = torch.zeros(0, 2, dtype=torch.long, device=device)
        return _Pairs(h, empty, empty, empty.to(torch.int8), torch.arange(h, device=device))

    def project_algebra(self, X: Tensor) -> Tensor:
        return X


@dataclass(frozen=True)
class RotaryGroup(_BlockDiagonalGroup):
    r"""The commutant of rotary position encodings,
    :math:`\mathrm{GL}(1, \mathbb{C})^{r/2} \times \mathrm{GL}(h - r)` with r = ``rotary_dim``.

    * ``pairing``: which coordinates of a head rotate together: ``"half"``: (i, i + r/2), Hugging
      Face ``rotate_half`` (Llama, Mistral, Qwen, Phi, GPT-NeoX); ``"interleaved"``: (2i, 2i+1),
      the complex-number layout (original Llama, GPT-J, RoFormer).
    * ``rotary_dim``: number of rotated coordinates (the first r of the head, as in GPT-NeoX's and
      Phi's partial rotary); None means all h. The remaining h − r coordinates form a GL block.

    Assumes pairwise distinct, nonzero rotation frequencies (true for RoPE's
    :math:`\theta_i = \mathrm{base}^{-2i/r}`);
    ``Layout.verify`` checks the symmetry on the real model.

    Parameters
    ----------
    pairing:
        ``"half"`` (default) or ``"interleaved"``.
    rotary_dim:
        Number of rotated coordinates, a positive even integer, or None for all of them.

    Raises
    ------
    ValueError
        ``pairing`` is not a known pairing or ``rotary_dim`` is not a positive even integer; and,
        from :meth:`check`, when ``rotary_dim`` exceeds the head dimension h.

    Examples
    --------
    >>> from quotient_manifolds.core import GLQuotientGeometry, RotaryGroup
    >>> group = RotaryGroup(pairing="interleaved", rotary_dim=2)
    >>> group.dim(4)                            # 2 for the rotated pair + (4 - 2)² for the rest
    6
    >>> GLQuotientGeometry(6, 6, 4, group=group).dim
    42
    """

    pairing: str = "half"
    rotary_dim: Optional[int] = None

    name = "rotary"

    def __post_init__(self):
        if self.pairing not in PAIRINGS:
            raise InvalidArgument(f"unknown rotary pairing {self.pairing!r}; valid choices are "
                                  f"{', '.join(map(repr, PAIRINGS))}")
        r = self.rotary_dim
        if r is not None and (isinstance(r, bool) or not isinstance(r, numbers.Integral) or r < 2 or r % 2):
            raise InvalidArgument(f"rotary_dim must be a positive even integer (or None for all "
                                  f"coordinates), got {r!r}")

    def rotated(self, h: int) -> int:
        return h if self.rotary_dim is None else self.rotary_dim

    def check(self, h: int) -> None:
        r = self.rotated(h)
        if r > h or r % 2:
            raise InvalidArgument(f"rotary group with rotary_dim={r} does not fit a head of dimension "
                                  f"h = {h}: need an even rotary_dim ≤ h")

    def dim(self, h: int) -> int:
        r = self.rotated(h)
        return r + (h - r) ** 2

    def describe(self, h: int) -> str:
        r = self.rotated(h)
        rot = f"GL(1,C)^{r // 2} [{self.pairing} pairs]"
        return rot if r == h else f"{rot} x GL({h - r}) [rotary_dim={r}]"

    def pairs(self, h: int) -> Tuple[Tuple[int, int], ...]:
        r = self.rotated(h)
        if self.pairing == "half":
            return tuple((i, i + r // 2) for i in range(r // 2))
        return tuple((2 * i, 2 * i + 1) for i in range(r // 2))

    @functools.lru_cache(maxsize=64)
    def structure(self, h: int, device=None) -> _Pairs:
        self.check(h)
        rows, cols, signs = [], [], []
        for p, q in self.pairs(h):
            rows += [(p, q), (q, p)]          # I: (p,p),(q,q);  J: (q,p),(p,q)
            cols += [(p, q), (p, q)]
            signs += [(1, 1), (1, -1)]
        as_t = functools.partial(torch.tensor, device=device)
        return _Pairs(h, as_t(rows, dtype=torch.long).reshape(-1, 2),
                      as_t(cols, dtype=torch.long).reshape(-1, 2),
                      as_t(signs, dtype=torch.int8).reshape(-1, 2),
                      torch.arange(self.rotated(h), h, device=device))


Group = SymmetryGroup
FULL_GL = GLGroup()


def as_group(group: Union[None, str, Group]) -> Group:
    """A group object from ``None``/``"gl"`` (full GL(h)), ``"rope"``/``"rotary"`` (rotary
    commutant, rotate_half pairing, all coordinates rotated) or a group instance (any
    :class:`SymmetryGroup`: also the groups of :mod:`quotient_manifolds.core.subalgebra`).

    Parameters
    ----------
    group:
        ``None``, ``"gl"``, ``"rope"``, ``"rotary"`` or a :class:`SymmetryGroup`.

    Returns
    -------
    SymmetryGroup
        The group object (``group`` itself when it is one).

    Raises
    ------
    ValueError
        ``group`` is a string that names no group.

    Examples
    --------
    >>> from quotient_manifolds.core import as_group
    >>> as_group("gl").describe(4)
    'GL(4)'
    >>> as_group("rope").dim(4)                 # one rotation-scaling a·I + b·J per pair
    4
    """
    if isinstance(group, SymmetryGroup):
        return group
    if group is None or group == "gl":
        return FULL_GL
    if group in ("rope", "rotary"):
        return RotaryGroup()
    raise InvalidArgument(f"unknown group {group!r}; use 'gl', 'rope', or a group object such as "
                          f"RotaryGroup(pairing='interleaved', rotary_dim=32)")


class VerticalSolver:
    """Λ ∈ 𝔤 with Π_𝔤 L(Λ) = Π_𝔤 C at one point (module docstring), set up once per point.

    For the full GL(h) it uses the frame's Sylvester basis (one pencil diagonalisation); for the
    rotary group it adds the Schur complement over the pair coefficients."""

    def __init__(self, group: Group, frame):
        h = frame.G.shape[-1]
        self.st = group.structure(h, frame.G.device)
        F = self.st.free
        self.full = F.numel() == h
        #: (N_G, N_H) when L(Λ) = 2 M_H Λ M_G (mix, ε = 0): then Λ = ½ N_H C N_G, two products
        self.closed_form = None
        if self.full and frame.gl_metric.closed_form_projection(frame.eps):
            self.closed_form = frame.inverse_metric_weights
            return
        A, A2 = frame.gram_G, frame.metric_weights[1]          # L(Λ) = AΛB + A2ΛB2
        B, B2 = frame.metric_weights[0], frame.gram_H
        if self.full:
            self.free_basis = frame._projection_basis
        elif F.numel():
            sub = lambda X: X[..., F[:, None], F[None, :]]  # noqa: E731
            self.free_basis = pencil_basis(_inverse_factor(sub(A2)), sub(A),
                                           _inverse_factor(sub(B)), sub(B2))
        else:
            self.free_basis = None
        if not self.st.n_coef:
            return
        ra, ca, sa = self.st.rows, self.st.cols, self.st.signs.to(A.dtype)
        # K_ab = Σ_{t,t'} s_t s'_t' (A[r_t, r'_t'] B[c'_t', c_t] + A2[..] B2[..])
        I_r, J_r = ra[:, :, None, None], ra[None, None, :, :]
        I_c, J_c = ca[None, None, :, :], ca[:, :, None, None]
        ss = sa[:, :, None, None] * sa[None, None, :, :]
        K = ((A[..., I_r, J_r] * B[..., I_c, J_c] + A2[..., I_r, J_r] * B2[..., I_c, J_c]) * ss
             ).sum((-3, -1))
        if F.numel():
            # V_b = Σ_t' s'_t' (A[F, r'] ⊗ B[c', F] + A2[F, r'] ⊗ B2[c', F])
            rb, cb = ra.reshape(-1), ca.reshape(-1)
            def outer(X, Y):
                left = X[..., F[:, None], rb[None, :]]          # (..., f, 2·d_r)
                right = Y[..., cb[:, None], F[None, :]]         # (..., 2·d_r, f)
                return left.mT[..., :, :, None] * right[..., :, None, :]
            V = (outer(A, B) + outer(A2, B2)) * sa.reshape(-1)[:, None, None]
            V = V.unflatten(-3, (self.st.n_coef, 2)).sum(-3)    # (..., d_r, f, f)
            W = apply_pencil(tuple(t[..., None, :, :] for t in self.free_basis), V)
            K = K - torch.einsum("...afg,...bfg->...ab", V, W)
            self.W = W
        else:
            self.W = None
        self.schur_chol = torch.linalg.cholesky(sym(K))

    def solve(self, C: Tensor) -> Tensor:
        """Λ ∈ 𝔤 (..., h, h) with Π_𝔤 L(Λ) = Π_𝔤 C."""
        if self.closed_form is not None:
            N_G, N_H = self.closed_form
            return matmul(matmul(N_H, C), N_G).mul_(0.5)
        if self.full:
            return apply_pencil(self.free_basis, C)
        F = self.st.free
        rhs = self.st.coefficients(C)
        if self.W is not None:
            C_FF = C[..., F[:, None], F[None, :]]
            Y0 = apply_pencil(self.free_basis, C_FF)
            rhs = rhs - (self.W * C_FF[..., None, :, :]).sum((-1, -2))
        c = torch.cholesky_solve(rhs[..., None], self.schur_chol)[..., 0]
        lam = self.st.assemble(c)
        if self.W is not None:
            lam[..., F[:, None], F[None, :]] = Y0 - (c[..., :, None, None] * self.W).sum(-3)
        return lam
