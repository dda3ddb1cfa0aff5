"""Fixtures for the chart's cluster tests: one local control plane (hack/kvbridge_cluster.py)
per session, and helm/kubectl bound to it with private helm state directories."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from chartlib import Kube


@pytest.fixture(scope="session")
def kube(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Kube]:
    import kvbridge_cluster

    try:
        binaries = kvbridge_cluster.Binaries.find()
    except kvbridge_cluster.StackMissingError as exc:
        pytest.fail(str(exc), pytrace=False)  # never a silent skip: CI must run these
    cluster = kvbridge_cluster.LocalCluster(
        workdir=tmp_path_factory.mktemp("chart-cluster"), binaries=binaries
    )
    with cluster:
        yield Kube(cluster=cluster, helm_home=tmp_path_factory.mktemp("helm"))
