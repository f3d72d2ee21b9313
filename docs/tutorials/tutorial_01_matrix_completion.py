r"""
Low-rank matrix completion on the GL(h) quotient with geoopt
============================================================

A rank-h matrix :math:`X = G H^\top` does not determine its factors: :math:`(G A, H A^{-\top})`
gives the same product for every invertible :math:`A`. The set of factor pairs modulo this
action is the quotient manifold :math:`\mathbb{R}_*^{n\times h}\times\mathbb{R}_*^{m\times h}/\mathrm{GL}(h)`,
and :class:`~quotient_manifolds.geoopt.GLQuotient` makes it a geoopt manifold: the Riemannian
gradient is horizontal (it never moves along the orbit, where the cost is flat) and is measured in
a GL(h)-invariant metric.

Here we recover a rank-4 matrix of size 60 × 40 from 60 % of its entries, with geoopt's Riemannian
SGD on that manifold, and follow the error on *all* entries.

Install, in a clone of the repository (the package is not on PyPI yet; a wheel built from the
clone works too, see :doc:`/install`): ``pip install -e . matplotlib`` (matplotlib draws the
figure).
"""

# %%
# The problem and the manifold
# ----------------------------
# A point is one tensor ``x = [G; H]`` of shape ``(n + m, h)``; ``M.split(x)`` returns views of
# its two factors. The ``"mix"`` metric is Mishra & Sepulchre's preconditioned metric
# :math:`\mathrm{tr}(Q\,\xi_G^\top\eta_G) + \mathrm{tr}(P\,\xi_H^\top\eta_H)` with
# :math:`P = G^\top G`, :math:`Q = H^\top H`.
import geoopt
import matplotlib.pyplot as plt
import torch

from quotient_manifolds import GLQuotient

torch.manual_seed(0)
n, m, h = 60, 40, 4
target = torch.randn(n, h, dtype=torch.float64) @ torch.randn(h, m, dtype=torch.float64)
mask = torch.rand(n, m) < 0.6                          # the entries we observe
M = GLQuotient(n, m, h, metric="mix")
print(M)

# %%
# Riemannian SGD with momentum
# ----------------------------
# The optimiser only sees the observed entries; the relative error is measured on all of them.
x = geoopt.ManifoldParameter(M.random(dtype=torch.float64), manifold=M)
first_start = x.detach().clone()                       # kept for the last section
opt = geoopt.optim.RiemannianSGD([x], lr=0.5, momentum=0.5)
losses, errors = [], []
for step in range(300):
    opt.zero_grad()
    G, H = M.split(x)
    loss = 0.5 * ((G @ H.T - target)[mask] ** 2).sum()
    loss.backward()
    opt.step()
    with torch.no_grad():
        G, H = M.split(x)
        losses.append(loss.item())
        errors.append(((G @ H.T - target).norm() / target.norm()).item())
print(f"training loss {losses[0]:.3g} -> {losses[-1]:.3g}")
print(f"relative error on all entries: {errors[0]:.3g} -> {errors[-1]:.1e}")

# %%
# Convergence
# -----------
# The loss on the observed entries and the error on all entries fall together: the 40 % of
# entries the optimiser never saw are recovered too, because the iterate stays rank 4.
fig, ax = plt.subplots(figsize=(6.4, 3.6))
ax.semilogy(losses, label="loss on observed entries")
ax.semilogy(errors, label="relative error, all entries")
ax.set_xlabel("Riemannian SGD step")
ax.set_title("Matrix completion on GL(4) quotient, mix metric")
ax.grid(True, which="both", alpha=0.3)
ax.legend()
fig.tight_layout()
plt.show()

# %%
# The invariance the quotient buys
# --------------------------------
# Acting on the starting point with any invertible :math:`A` changes the factors but not the
# product, and the Riemannian gradient transforms with the point: the optimiser's trajectory of
# :math:`G H^\top` is the same from every representative. One step from both representatives:
A = torch.randn(h, h, dtype=torch.float64)
x0 = M.random(dtype=torch.float64)
G0, H0 = M.split(x0)
x1 = torch.cat([G0 @ A, H0 @ torch.linalg.inv(A).T])
products = []
for start in (x0, x1):
    p = geoopt.ManifoldParameter(start.clone(), manifold=M)
    sgd = geoopt.optim.RiemannianSGD([p], lr=0.1)
    G, H = M.split(p)
    (0.5 * ((G @ H.T - target)[mask] ** 2).sum()).backward()
    sgd.step()
    G, H = M.split(p.detach())
    products.append(G @ H.T)
rel = ((products[0] - products[1]).norm() / products[0].norm()).item()
print(f"after one step, G Hᵀ from the two representatives differs by {rel:.1e} (relative)")

# %%
# Inside an ``nn.Module``
# -----------------------
# A point is one tensor ``x = [G; H]``, so ``G`` and ``H`` cannot be two separate parameters that
# the optimiser updates on their own: it must see the point. In a module of your own, make ``x``
# the parameter and take the factors where they are used, ``G, H = M.split(x)`` (views: no copy,
# the gradient reaches ``x``). A module that already holds the two factors as separate weights —
# here a rank-4 layer made of two ``nn.Linear`` — can stay as it is: call it with its weights taken
# from the point (``torch.func.functional_call``), and copy the trained factors back at the end.
# (For peft LoRA models :func:`~quotient_manifolds.adapters.lora_quotient_parameters` does this.)
from torch import nn
from torch.func import functional_call

layer = nn.Sequential(nn.Linear(m, h, bias=False), nn.Linear(h, n, bias=False)).double()
# the layer's matrix is W1 W0, with W1 of shape (n, h) and W0 of shape (h, m): G = W1, H = W0ᵀ.
# Its weights here start where the first run started.
with torch.no_grad():
    layer[1].weight.copy_(M.split(first_start)[0])
    layer[0].weight.copy_(M.split(first_start)[1].T)
x = geoopt.ManifoldParameter(M.pack(layer[1].weight.detach(), layer[0].weight.detach().T), manifold=M)
opt = geoopt.optim.RiemannianSGD([x], lr=0.5, momentum=0.5)     # the first run's optimiser
eye = torch.eye(m, dtype=torch.float64)        # the layer applied to the unit vectors: its matrix
for step in range(300):
    opt.zero_grad()
    G, H = M.split(x)
    W = functional_call(layer, {"0.weight": H.T, "1.weight": G}, (eye,)).T      # G Hᵀ, (n, m)
    loss = 0.5 * ((W - target)[mask] ** 2).sum()
    loss.backward()
    opt.step()
with torch.no_grad():                          # the trained factors back into the module
    G, H = M.split(x)
    layer[1].weight.copy_(G)
    layer[0].weight.copy_(H.T)
W = layer(eye).T.detach()
print(f"the layer's matrix, relative error on all entries: "
      f"{((W - target).norm() / target.norm()).item():.1e} (the first run: {errors[-1]:.1e})")
