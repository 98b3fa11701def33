"""`epd-operator run`: kopf with the operator's handlers, namespaces, peering and logging."""

from __future__ import annotations

import logging
import random

import kopf

from . import indexing_gate, watch_decoding
from .loop import event_loop
from .settings import Settings


class SharedMemo(kopf.Memo):
    """kopf gives every watched object a shallow copy of the memo (six objects per
    EPDDeployment, 200 bytes each); the operator's state lives in the one Reconciler it holds,
    so all objects share this memo instead."""

    def __copy__(self) -> SharedMemo:
        return self


_FORMATS = {"plain": kopf.LogFormat.PLAIN, "full": kopf.LogFormat.FULL, "json": kopf.LogFormat.JSON}


def run(
    *,
    namespaces: list[str],
    all_namespaces: bool,
    peering: str | None,
    standalone: bool,
    priority: str,
    liveness: str | None,
    metrics_port: int,
    settings: Settings,
    log_level: str,
    log_format: str,
) -> None:
    if not namespaces and not all_namespaces:
        raise SystemExit("epd-operator run: pass --namespace NAME (repeatable) or --all-namespaces")
    if peering and standalone:
        raise SystemExit("epd-operator run: --peering and --standalone exclude each other")
    if priority != "random" and not priority.lstrip("-").isdigit():
        raise SystemExit(f"epd-operator run: --priority takes an integer or 'random', not {priority!r}")
    kopf.configure(
        debug=log_level == "DEBUG",
        verbose=log_level in ("DEBUG", "INFO"),
        quiet=log_level in ("WARNING", "ERROR"),
        log_format=_FORMATS[log_format],
        log_refkey="epd" if log_format == "json" else None,
    )
    logging.getLogger().setLevel(log_level)
    if log_level == "INFO":
        # kopf logs "Handler ... succeeded" per handler per watch event at INFO: with level-based
        # handlers that is a line per event (and 3 % of the CPU at 1,000 objects). DEBUG shows it.
        logging.getLogger("kopf.objects").setLevel(logging.WARNING)
    from . import handlers  # noqa: F401  (registers the handlers)
    from .reconciler import Reconciler

    indexing_gate.install()
    watch_decoding.install()
    reconciler = Reconciler(settings)
    if metrics_port:
        reconciler.metrics.serve(metrics_port)
    with event_loop() as runner:
        kopf.run(
            loop=runner.get_loop(),
            clusterwide=all_namespaces,
            namespaces=namespaces,
            standalone=standalone or not peering,
            peering_name=peering,
            priority=random.randrange(1, 2**31) if priority == "random" else int(priority),
            liveness_endpoint=liveness or None,
            memo=SharedMemo(reconciler=reconciler),  # every handler reaches it as memo.reconciler
        )
