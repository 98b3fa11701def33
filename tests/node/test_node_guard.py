"""One real node per machine: a second cluster asking for it is refused, saying whose it is,
and the running node is left alone."""

from __future__ import annotations

import pytest

from epd_dev.localcluster import LocalCluster, node

pytestmark = [pytest.mark.node, pytest.mark.cluster]


def test_a_second_cluster_cannot_take_the_real_node(cluster, real_node, tmp_path):
    second = LocalCluster(tmp_path / "second", nodes=1, real_nodes=1)
    with pytest.raises(node.NodeBusy, match=str(cluster.dir)):
        second.start()
    assert real_node.owned() and real_node.containerd_ready()
    assert (
        "Ready=True"
        in cluster.kubectl(
            "get", "node", node.NAME, "-o", "jsonpath={range .status.conditions[*]}{.type}={.status} {end}"
        ).stdout
    )
    assert not (tmp_path / "second" / "state.json").exists()
