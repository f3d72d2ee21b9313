"""``python -m experiments``: see :mod:`experiments.cli`."""

import os
import sys

# The studies do many small dense operations (numpy, torch). Multi-threaded BLAS on a loaded
# machine oversubscribes the cores and can be 100x slower (measured: 47 s instead of 0.16 s for a
# diagonal-net sharpness); parallelism comes from --workers instead. Respect explicit settings.
for _var in ("OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

from .cli import main  # noqa: E402  (after the environment is set)

if __name__ == "__main__":
    sys.exit(main())
