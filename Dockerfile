# kvbridge images, built from the repository root. Two final stages:
#
#   operator (the last stage, so a plain build gives it): the operator image the Helm chart runs
#     (values.yaml image.repository): the kvbridge_operator package and the `kopf` command.
#       docker build -t ghcr.io/kvbridge/kvbridge-operator:0.1.0 .
#   agent: the agent library with NIXL (nixl-cu12, installed --no-deps: no torch) and the
#     demo's engine stand-in (demo/pod_agent.py) as the entrypoint, for simulated P/D pods.
#       docker build --target agent -t kvbridge-agent:dev .
#
# Both run as the numeric non-root user 65532 (the chart's securityContext requires one) from a
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

FROM build AS build-agent
# The vllm extra adds the Kubernetes client; pyyaml serves pod_agent.py's optional import.
RUN pip install '.[vllm]' pyyaml==6.0.4 \
 && pip install --no-deps nixl-cu12==1.5.1

FROM build AS build-operator
RUN pip install '.[operator]'

FROM ${BASE} AS agent
COPY --from=build-agent /opt/kvbridge /opt/kvbridge
# pod_agent.py imports bridge (demo/bridge.py) only with --api-uds.
COPY demo/pod_agent.py demo/bridge.py /opt/kvbridge/app/
ENV PATH=/opt/kvbridge/bin:$PATH PYTHONUNBUFFERED=1
USER 65532:65532
ENTRYPOINT ["/opt/kvbridge/bin/python", "/opt/kvbridge/app/pod_agent.py"]

FROM ${BASE} AS operator
COPY --from=build-operator /opt/kvbridge /opt/kvbridge
ENV PATH=/opt/kvbridge/bin:$PATH PYTHONUNBUFFERED=1
USER 65532:65532
ENTRYPOINT ["/opt/kvbridge/bin/kopf"]
CMD ["run", "--all-namespaces", "--module=kvbridge_operator.main"]
