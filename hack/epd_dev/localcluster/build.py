"""Build the control plane binaries once: ``python -m epd_dev.localcluster.build``.

A thin entry point; the work is in ``epd_dev.localcluster.binaries`` (kept separate
so that importing the package does not pre-import the module ``-m`` runs).
Re-exports the common calls for ``from epd_dev.localcluster import build``.
"""

import sys

from .binaries import bin_dir, build, main, missing_binaries

__all__ = ["bin_dir", "build", "main", "missing_binaries"]

if __name__ == "__main__":
    sys.exit(main())
