"""geoopt faces of the quotient geometries: ``geoopt.manifolds.base.Manifold`` subclasses that
only delegate to :mod:`quotient_manifolds.core` (docs/maths.md Appendix A)."""

from .gl_quotient import GLQuotient
from .optim import RiemannianLineSearch, RiemannianSGD, init_momentum_buffers
from .rescaling import RescalingQuotient

__all__ = ["GLQuotient", "RescalingQuotient", "RiemannianSGD", "RiemannianLineSearch",
           "init_momentum_buffers"]
