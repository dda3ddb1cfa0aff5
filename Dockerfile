# The operator image the Helm chart runs (values.yaml image.repository): the kvbridge_operator
# package and the `kopf` command, non-root. Build from the repository root:
#
#   docker build -t ghcr.io/kvbridge/kvbridge-operator:0.1.0 .
#
# The chart supplies the command (`kopf run --module=kvbridge_operator.main ...`). No Docker
# engine runs on the project's CI machines, so this file is not built there; the chart tests
# run that same command from the project's virtualenv instead.
FROM python:3.11-slim AS build
WORKDIR /src
COPY pyproject.toml README.md ./
COPY agent agent
COPY operator operator
RUN pip install --no-cache-dir --prefix=/install ".[operator]"

FROM python:3.11-slim
COPY --from=build /install /usr/local
# The chart's securityContext requires a numeric non-root user.
USER 65532:65532
ENTRYPOINT ["kopf"]
CMD ["run", "--all-namespaces", "--module=kvbridge_operator.main"]
