"""kvbridge's test harness: what the tests, benchmarks and demo run kvbridge against.

- :mod:`kvbridge_testkit.cluster`: a local Kubernetes control plane (``LocalCluster``), a
  node simulator (``FakeKubelet``), the test-stack binaries and small process helpers.
- :mod:`kvbridge_testkit.node`: a real kubelet node (``RealNode``) and its images.
- :mod:`kvbridge_testkit.prometheus`: a real Prometheus on loopback with the chart's rules.
- :mod:`kvbridge_testkit.operator_process`: the operator as a local ``kopf run`` process.

It drives this checkout (the chart, the CRDs, hack/'s build scripts), so it is installed
editable from the checkout (``make venv``) and never shipped in kvbridge's wheel or images.
"""

from pathlib import Path

__all__ = ["HACK", "REPO"]

#: The repository root: the chart, the CRDs and hack/'s scripts are read from here.
REPO = Path(__file__).resolve().parents[2]
#: The build scripts (test-stack.sh, node-images.sh, vllm-venv.sh) and operator-rbac.yaml.
HACK = REPO / "hack"
