"""The operator killed (kill -9) and started again at scale (`make bench`): with n EPDDeployments
converged and their units Ready, how long until the new process has reconciled every one of them,
and what it writes meanwhile. Nothing changed while it was down, so the target is no write at all.

The writes are counted by the API server itself (`apiserver_request_duration_seconds_count`), for
the resources only the operator writes in the benchmark: its children (StatefulSets, Services,
PodDisruptionBudgets and NetworkPolicies, not their status subresources, which kcm writes) and
the EPDDeployments' status.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

from epd_operator.kube import CHILD_KINDS

from ..operator_process import OperatorProcess
from .kit import Api, log
from .observe import apiserver_requests, request_delta

# The resources of the API server's request metric: the last segment of each collection path.
CHILD_RESOURCES = tuple(path.rsplit("/", 1)[1] for path in CHILD_KINDS.values())
STATUS_RESOURCE = "epddeployments/status"
WRITE_VERBS = ("POST", "PUT", "PATCH", "APPLY", "DELETE")
READY_SERIES = "epd_ready_units{"  # set by each status computation: one series per EPDDeployment reconciled


@dataclass
class Restart:
    n: int
    seconds: float  # from the new process' start until it had reconciled every EPDDeployment
    child_writes: float
    status_writes: float
    events: float  # Events POSTed meanwhile (by anyone: kcm's and the scheduler's too)
    reconciles: float  # the new process' successful reconciles until the end of the window

    @property
    def writes(self) -> float:
        return self.child_writes + self.status_writes


def _reconciled(operator: OperatorProcess) -> tuple[int, float]:
    """(EPDDeployments the operator has computed a status for, successful reconciles)."""
    text = operator.metrics()
    keys = sum(line.startswith(READY_SERIES) for line in text.splitlines())
    success = sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith('epd_reconciles_total{result="success"}')
    )
    return keys, success


def measure_restart(
    api: Api, operator: OperatorProcess, n: int, *, quiet_seconds: float = 10, timeout: float = 600
) -> Restart:
    """kill -9 the operator, start it again, wait until it has reconciled all n EPDDeployments
    and then `quiet_seconds` without a reconcile (seconds: inf if not within `timeout`); the
    writes from the kill to then."""
    before = apiserver_requests(api)
    operator.kill()
    began = time.monotonic()
    operator.start()
    deadline = began + timeout
    steady_at = None
    last_change, last = time.monotonic(), (0, 0.0)
    while True:
        now = time.monotonic()
        if now > deadline:
            log(f"  restart: the new operator had reconciled {last[0]} of {n} after {timeout:.0f} s")
            break
        current = _reconciled(operator)
        if current != last:
            last, last_change = current, now
        if steady_at is None and current[0] >= n:
            steady_at = now
        if steady_at is not None and now - last_change >= quiet_seconds:
            break
        time.sleep(0.1)
    delta = request_delta(before, apiserver_requests(api))

    def writes(resources: tuple[str, ...]) -> float:
        return sum(
            count for (verb, resource), (count, _) in delta.items() if verb in WRITE_VERBS and resource in resources
        )

    restart = Restart(
        n,
        seconds=math.inf if steady_at is None else steady_at - began,
        child_writes=writes(CHILD_RESOURCES),
        status_writes=writes((STATUS_RESOURCE,)),
        events=writes(("events",)),
        reconciles=last[1],
    )
    log(
        f"  restart: all {n} reconciled {restart.seconds:.1f} s after the start; writes: "
        f"{restart.child_writes:.0f} to children, {restart.status_writes:.0f} to statuses"
    )
    return restart


def report_restart(r: Restart, out: Callable[[str], None]) -> None:
    out("")
    out(f"restart: kill -9 of the operator with {r.n} EPDDeployments converged and Ready, then a new one")
    out(f"  every EPDDeployment reconciled      {r.seconds:6.1f} s after its start ({r.reconciles:.0f} reconciles)")
    out(f"  writes to children / to statuses   {r.child_writes:.0f} / {r.status_writes:.0f}")
    out(f"  Events POSTed meanwhile (anyone)    {r.events:.0f}")
