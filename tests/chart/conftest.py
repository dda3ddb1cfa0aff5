"""Fixtures for the chart's cluster tests: one local control plane (kvbridge_testkit.cluster)
per session, and helm/kubectl bound to it with private helm state directories."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from chartlib import Kube


@pytest.fixture(scope="session")
def kube(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Kube]:
    from kvbridge_testkit import cluster as kc

    try:
        binaries = kc.Binaries.find()
    except kc.StackMissingError as exc:
        pytest.fail(str(exc), pytrace=False)  # never a silent skip: CI must run these
    cluster = kc.LocalCluster(
        workdir=tmp_path_factory.mktemp("chart-cluster"), binaries=binaries
    )
    with cluster:
        yield Kube(cluster=cluster, helm_home=tmp_path_factory.mktemp("helm"))
