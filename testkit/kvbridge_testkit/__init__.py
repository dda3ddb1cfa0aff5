"""kvbridge's test harness: what the tests, benchmarks and demo run kvbridge against.

- :mod:`kvbridge_testkit.cluster`: a local Kubernetes control plane (``LocalCluster``);
  :mod:`~kvbridge_testkit.fake_kubelet` its node simulator, :mod:`~kvbridge_testkit.stack` its
  binaries, :mod:`~kvbridge_testkit.procs` free ports and stopping children.
- :mod:`kvbridge_testkit.node`: a real kubelet node (``RealNode``; node_net, node_setup and
  node_teardown hold its addressing, images and config files, and teardown).
- :mod:`kvbridge_testkit.prometheus`: a real Prometheus on loopback with the chart's rules.
- :mod:`kvbridge_testkit.operator_process`: the operator as a local ``kopf run`` process;
  :mod:`~kvbridge_testkit.e2e` installs it as in production, :mod:`~kvbridge_testkit.load`
  plays a fleet of restarting agents against it.
- :mod:`kvbridge_testkit.envoy`: a real Envoy in front of the endpoint picker.
- Serving pods: :mod:`~kvbridge_testkit.sim` (a Pod object and a ``pod_agent.py`` process),
  :mod:`~kvbridge_testkit.node_pods` (the agent image on real nodes),
  :mod:`~kvbridge_testkit.vllm_pods` (examples/serving/ on real nodes).
- Real vLLM engines: :mod:`~kvbridge_testkit.vllm_harness` (engines over JSON lines),
  :mod:`~kvbridge_testkit.vllm_servers` (``vllm serve`` processes).

``pod_agent.py`` also runs as a script, as the agent image's entrypoint (with ``bridge.py``
beside it and without this package); run so, this folder comes first on ``sys.path``, so no
module here may take a standard library module's name.

It drives this checkout (the chart, the CRDs, hack/'s build scripts), so it is installed
editable from the checkout (``make venv``) and never shipped in kvbridge's wheel or images.
"""

from pathlib import Path

__all__ = ["HACK", "REPO"]

#: The repository root: the chart, the CRDs and hack/'s scripts are read from here.
REPO = Path(__file__).resolve().parents[2]
#: The build scripts (test-stack.sh, node-images.sh, vllm-venv.sh) and operator-rbac.yaml.
HACK = REPO / "hack"
