r"""
The invariance check: geodesic sharpness ignores the GL(h) symmetry, adaptive does not
======================================================================================

Acting on a head's factors with an invertible matrix :math:`A`,

.. math::

    (W_Q, W_K) \mapsto (W_Q A, W_K A^{-\top}), \qquad (W_V, W_O^\top) \mapsto (W_V A, W_O^\top A^{-\top}),

leaves :math:`W_Q W_K^\top` and :math:`W_V W_O` and so the network's function unchanged. A measure
of sharpness that is meant to say something about the *function* should not change either. Here
we reparametrise a small BERT with :math:`A = a \cdot \mathcal{N}(0, 1)` per head for scales
:math:`a` from :math:`10^{-2}` to :math:`10^{2}` and compare each sharpness with its value on the
original weights (the paper's §6.2 check uses
:math:`A = a \cdot \mathcal{N}(0, 1)`). Adaptive sharpness measures each weight relative to its
own size, so it already ignores a plain rescaling :math:`A = a I`; what it cannot ignore is an
ill-conditioned :math:`A`. So we draw :math:`A = U \operatorname{diag}(s) V^\top` per head, with
random orthogonal :math:`U, V` and singular values :math:`s` spread over a condition number from 1
to :math:`10^4`. The model is in float64, so that the reparametrised weights represent the same
function to rounding.

Install, in a clone of the repository (the package is not on PyPI yet; a wheel built from the
clone works too, see :doc:`/install`): ``pip install -e ".[hf]" matplotlib`` (matplotlib draws the
figure).
"""

# %%
import matplotlib.pyplot as plt
import torch
from transformers import BertConfig, BertForSequenceClassification

from quotient_manifolds import adapters

torch.manual_seed(0)
config = BertConfig(vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                    intermediate_size=64)
model = BertForSequenceClassification(config).double().eval()
ids, labels = torch.randint(0, 128, (16, 10)), torch.randint(0, 2, (16,))
batches = [({"input_ids": ids}, labels)]
layout = adapters.layout(model)


def reparametrised(cond: float, seed: int):
    """A copy of ``model`` with every GL block's heads acted on by a random element of condition
    number ``cond``: (G, H) -> (G A, H A^-T) per head. ``model`` itself is left alone."""
    params = {name: p.detach() for name, p in model.named_parameters()}
    actions = layout.random_actions(params, scale=1.0, cond=cond,
                                    generator=torch.Generator().manual_seed(seed))
    return layout.reparametrised(model, actions)


# %%
# The function is unchanged
# -------------------------
conds = [1.0, 1e1, 1e2, 1e3, 1e4]
models = [reparametrised(cond, seed) for seed, cond in enumerate(conds)]
with torch.no_grad():
    logits = model(ids).logits
    for cond, other in zip(conds, models):
        change = (other(ids).logits - logits).abs().max().item()
        print(f"cond(A) = {cond:<6g} largest logit change {change:.1e}")

# %%
# Sharpness before and after
# --------------------------
# Same radius, seed and iterations for every model; only the representative changes.
options = dict(rho=0.01, n_iters=10, seed=0)
base = {g: adapters.sharpness(model, batches, geometry=g, layout=layout, **options).value
        for g in adapters.GEOMETRIES}
ratios = {g: [] for g in adapters.GEOMETRIES}
for cond, other in zip(conds, models):
    for g in adapters.GEOMETRIES:
        ratios[g].append(adapters.sharpness(other, batches, geometry=g, **options).value / base[g])
    print(f"cond(A) = {cond:<6g}", "  ".join(f"{g}: {ratios[g][-1]:.4f}" for g in adapters.GEOMETRIES))

# %%
# The geodesic ratios stay at 1 for every action; the adaptive ratio grows with the
# conditioning of the action, although the function is the same.
fig, ax = plt.subplots(figsize=(6.4, 3.6))
for (g, values), style in zip(ratios.items(), ("o-", "s-", "^--")):
    ax.loglog(conds, values, style, label=g, markersize=8 if g == "geodesic-inv" else 6)
ax.axhline(1.0, color="grey", lw=0.8)
ax.set_xlabel("condition number of the per-head action A")
ax.set_ylabel("S(reparametrised) / S(original)")
ax.set_title("Sharpness under GL(h) reparametrisations")
ax.grid(True, which="both", alpha=0.3)
ax.legend()
fig.tight_layout()
plt.show()
