"""CLI: python -m epd_dev.localcluster up|down|status [--dir .cluster] [--nodes 4] [--real-nodes 1]"""

from __future__ import annotations

import argparse
import json
import sys

from ..images.build import import_into
from ..paths import REPO
from .cluster import ClusterError, LocalCluster
from .node import NodeError


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m epd_dev.localcluster",
        description="Run the local control plane (build it first: make cluster).",
    )
    parser.add_argument("command", choices=("up", "down", "status"))
    parser.add_argument("--dir", help="cluster folder (default: .cluster in the repo root)")
    parser.add_argument("--nodes", type=int, default=4, help="fake GPU nodes (default 4)")
    parser.add_argument(
        "--real-nodes", type=int, default=0, choices=(0, 1), help="up: also the real node epd-real-0 (default 0)"
    )
    parser.add_argument(
        "--recreate", action="store_true", help="up: start fresh even if a healthy cluster already runs in --dir"
    )
    args = parser.parse_args(argv)

    cluster = LocalCluster(
        args.dir or REPO / ".cluster",
        nodes=args.nodes,
        real_nodes=args.real_nodes,
        on_node_runtime=import_into,
    )
    try:
        if args.command == "up":
            if not args.recreate and cluster.status()["running"]:
                print(f"[cluster] already running in {cluster.dir} (use --recreate to start fresh)")
            else:
                cluster.start()
            print(f"export KUBECONFIG={cluster.kubeconfig} PATH={cluster.dir / 'bin'}:$PATH")
        elif args.command == "down":
            cluster.stop()
        else:
            status = cluster.status()
            print(json.dumps(status, indent=2))
            return 0 if status["running"] else 1
    except (ClusterError, NodeError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
