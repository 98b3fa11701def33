"""Kubernetes Events on an EPDDeployment, posted through kopf (in the background)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import kopf

Post = Callable[[Any, str, str], None]  # (body or object reference, reason, message)


def post_warning(body: Any, reason: str, message: str) -> None:
    kopf.warn(body, reason=reason, message=message)


def post_normal(body: Any, reason: str, message: str) -> None:
    """The milestones `kubectl describe` tells (rollouts)."""
    kopf.event(body, type="Normal", reason=reason, message=message)
