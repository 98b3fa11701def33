"""The kopf code the operator replaces at start (indexing_gate.py, watch_decoding.py), checked
against the kopf it was written for.

kopf offers no public hook for either change, so each replaces a name in one of kopf's private
modules. pyproject.toml pins kopf to the tested minor; within it, a release that changes a patched
module is run as it is, with a warning, rather than patched blindly: the operator is then only as
fast as plain kopf. The digests are of the modules' source as kopf 1.45.2 ships it;
tests/operator/test_runner.py fails when the installed kopf's differ.
"""

from __future__ import annotations

import hashlib
import inspect
import logging
from types import ModuleType

TESTED_KOPF = "1.45.2"

logger = logging.getLogger(__name__)


def digest(module: ModuleType) -> str:
    return hashlib.sha256(inspect.getsource(module).encode()).hexdigest()


def unchanged(module: ModuleType, tested_digest: str, what: str) -> bool:
    """Whether `module` is still the source `what` was written against; a warning if not."""
    if digest(module) == tested_digest:
        return True
    logger.warning(
        "%s is not installed: kopf's %s differs from kopf %s's, which it was written and tested "
        "against; the operator runs with kopf's own code (correct, slower at scale)",
        what,
        module.__name__,
        TESTED_KOPF,
    )
    return False
