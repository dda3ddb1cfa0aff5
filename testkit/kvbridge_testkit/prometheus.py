"""A real Prometheus on loopback for the tests and the demo: Debian's ``prometheus`` 2.42
package (with ``promtool``), installed by ``make test-stack`` (hack/test-stack.sh).

- :class:`PromBinaries` finds ``prometheus`` and ``promtool``; a missing one raises
  :class:`PrometheusMissingError` naming ``make test-stack``.
- :func:`chart_rules` renders the chart's PrometheusRule and returns its rule groups, as a
  Prometheus rule file wants them; :data:`FAST_ALERTS` shortens its ``for`` durations and
  windows for a run that lasts minutes.
- :func:`dashboard_queries` reads the PromQL of the chart's Grafana dashboard, and
  :func:`substitute` fills in its template variables.
- :class:`Prometheus` runs our own ``prometheus`` binary (never the package's service) on a
  free loopback port with a temporary config and TSDB, scraping file-discovered targets (set
  while it runs with :meth:`Prometheus.set_targets`), and answers queries, targets and alerts
  through the HTTP API.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import subprocess
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from kvbridge_testkit import REPO
from kvbridge_testkit.procs import free_port, terminate

CHART = REPO / "charts" / "kvbridge"
DASHBOARD = CHART / "dashboards" / "kvbridge.json"
RULES_TEMPLATE = "templates/prometheusrule.yaml"

#: Chart values that make every alert fire within seconds of its condition (the defaults
#: wait minutes): a `for` of two evaluations. Windows keep their defaults (10-15 minutes), so
#: whatever happened since Prometheus started counts.
FAST_ALERTS = [f"prometheusRule.alerts.{a}.for=2s" for a in (
    "transferDegraded", "transferNotReady", "incompatibleEndpoints", "handshakeFailures",
    "transferFailures", "operatorAbsent", "operatorNotReconciling")]
#: Scrape jobs as the chart's monitors make them: the operator's ServiceMonitor (job
#: "<release>-metrics", honorLabels so the KVTransfers' namespace label stays) and the agents'
#: PodMonitor (target labels namespace and pod).
OPERATOR_JOB, AGENT_JOB = "kvbridge-metrics", "kvbridge-agents"
#: The P/D router's pods, as the chart's router PodMonitor scrapes them.
ROUTER_JOB = "kvbridge-router"
JOBS = {OPERATOR_JOB: {"honor_labels": True}, AGENT_JOB: {}, ROUTER_JOB: {}}


class PrometheusMissingError(RuntimeError):
    """prometheus or promtool is not installed; the message says how to install them."""


@dataclass(frozen=True)
class PromBinaries:
    prometheus: Path
    promtool: Path

    @classmethod
    def find(cls) -> PromBinaries:
        """$KVB_PROMETHEUS / $KVB_PROMTOOL, else PATH (Debian's package: /usr/bin)."""
        found: dict[str, Path] = {}
        for name in ("prometheus", "promtool"):
            path = os.environ.get(f"KVB_{name.upper()}") or shutil.which(name)
            if not path or not os.access(path, os.X_OK):
                raise PrometheusMissingError(
                    f"{name} not found: run `make test-stack` (it installs Debian's prometheus "
                    "package, which brings promtool), or set "
                    f"KVB_{name.upper()} to the binary")
            found[name] = Path(path)
        return cls(**found)

    def promtool_run(self, *args: str, input: str | None = None, cwd: Path | None = None,
                     timeout: float = 60) -> subprocess.CompletedProcess[str]:
        """``promtool ARGS`` (not checked: callers assert on the exit code and output)."""
        return subprocess.run([str(self.promtool), *args], input=input, capture_output=True,
                              text=True, cwd=cwd, timeout=timeout, check=False)


def chart_rules(helm: str | Path, sets: Sequence[str] = (), *, release: str = "kvbridge",
                namespace: str = "kvbridge-system") -> dict[str, Any]:
    """``{"groups": [...]}`` of the chart's PrometheusRule rendered with ``sets``."""
    args = [str(helm), "template", release, str(CHART), "--namespace", namespace,
            "--show-only", RULES_TEMPLATE, "--set", "prometheusRule.enabled=true"]
    for s in sets:
        args += ["--set", s]
    proc = subprocess.run(args, capture_output=True, text=True, timeout=120, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"helm template of the PrometheusRule failed:\n{proc.stderr}")
    (rule,) = [d for d in yaml.safe_load_all(proc.stdout) if d]
    return {"groups": rule["spec"]["groups"]}


def alert_rules(rules: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """Alert name -> rule, over every group."""
    return {r["alert"]: r for g in rules["groups"] for r in g["rules"] if "alert" in r}


def dashboard_queries(path: Path = DASHBOARD) -> tuple[list[tuple[str, str]], list[str]]:
    """(panel title, expr) of every dashboard target, and the template variables' queries."""
    dash = json.loads(path.read_text())
    targets: list[tuple[str, str]] = []

    def walk(panels: Iterable[Mapping[str, Any]]) -> None:
        for p in panels:
            targets.extend((p["title"], t["expr"]) for t in p.get("targets", ()))
            walk(p.get("panels", ()))

    walk(dash["panels"])
    variables = [v["query"]["query"] if isinstance(v["query"], dict) else v["query"]
                 for v in dash["templating"]["list"] if v["type"] == "query"]
    return targets, variables


def substitute(expr: str, values: Mapping[str, str]) -> str:
    """Fill in ``$name`` / ``${name}`` (Grafana's ``$__rate_interval`` and ``$__range``
    included) from ``values``; an unknown variable is an error."""
    def one(m: re.Match[str]) -> str:
        name = m.group(1) or m.group(2)
        if name not in values:
            raise KeyError(f"no value for dashboard variable ${name} in {expr!r}")
        return values[name]

    return re.sub(r"\$\{(\w+)\}|\$(\w+)", one, expr)


@dataclass
class Prometheus:
    """Our own Prometheus process on ``127.0.0.1:<free port>``; see the module docstring.

    ``jobs`` maps a job name to its scrape settings (e.g. ``{"honor_labels": True}``); the
    targets of each come from a file (``set_targets``) that Prometheus watches.
    """

    binaries: PromBinaries
    jobs: Mapping[str, Mapping[str, Any]]
    rules: Mapping[str, Any] | None = None
    workdir: Path | None = None
    interval: str = "1s"
    port: int = 0
    proc: subprocess.Popen[bytes] | None = field(default=None, repr=False)
    _tmp: Any = field(default=None, repr=False)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def log_path(self) -> Path:
        assert self.workdir is not None
        return self.workdir / "prometheus.log"

    def start(self, timeout: float = 60.0) -> Prometheus:
        if self.workdir is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="kvb-prometheus-")
            self.workdir = Path(self._tmp.name)
        self.workdir.mkdir(parents=True, exist_ok=True)
        (self.workdir / "targets").mkdir(exist_ok=True)
        config: dict[str, Any] = {
            "global": {"scrape_interval": self.interval, "scrape_timeout": self.interval,
                       "evaluation_interval": self.interval},
            "scrape_configs": [
                {"job_name": job, **settings, "file_sd_configs": [
                    {"files": [str(self.workdir / "targets" / f"{job}.json")],
                     "refresh_interval": "1s"}]}
                for job, settings in self.jobs.items()],
        }
        if self.rules is not None:
            (self.workdir / "rules.yaml").write_text(yaml.safe_dump(dict(self.rules)))
            config["rule_files"] = [str(self.workdir / "rules.yaml")]
        (self.workdir / "prometheus.yml").write_text(yaml.safe_dump(config))
        for job in self.jobs:
            if not (self.workdir / "targets" / f"{job}.json").exists():
                self.set_targets(job, [])
        self.port = self.port or free_port()
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                [str(self.binaries.prometheus),
                 f"--config.file={self.workdir / 'prometheus.yml'}",
                 f"--storage.tsdb.path={self.workdir / 'data'}",
                 f"--web.listen-address=127.0.0.1:{self.port}",
                 "--storage.tsdb.retention.time=1d", "--log.level=warn"],
                stdout=log, stderr=subprocess.STDOUT, cwd=self.workdir)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"prometheus exited ({self.proc.returncode}):\n"
                                   f"{self.log_path.read_text(errors='replace')[-3000:]}")
            with contextlib.suppress(OSError), \
                    urllib.request.urlopen(f"{self.url}/-/ready", timeout=2) as r:
                if r.status == 200:
                    return self
            time.sleep(0.2)
        raise RuntimeError(f"prometheus not ready within {timeout} s:\n"
                           f"{self.log_path.read_text(errors='replace')[-3000:]}")

    def stop(self) -> None:
        if self.proc is not None:
            terminate(self.proc, 15)
            self.proc = None
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    def __enter__(self) -> Prometheus:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def set_targets(self, job: str, targets: Iterable[tuple[str, Mapping[str, str]]]) -> None:
        """Replace the targets (``host:port``, target labels) of ``job``; written atomically
        so that Prometheus never reads half a file."""
        assert self.workdir is not None
        path = self.workdir / "targets" / f"{job}.json"
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps([{"targets": [addr], "labels": dict(labels)}
                                   for addr, labels in targets]))
        os.replace(tmp, path)

    def api(self, path: str, **params: str) -> Any:
        """GET ``/api/v1/<path>``; the ``data`` of a success, else RuntimeError."""
        query = urllib.parse.urlencode(params)
        url = f"{self.url}/api/v1/{path}" + (f"?{query}" if query else "")
        try:
            with urllib.request.urlopen(url, timeout=10) as r:
                body = json.load(r)
        except urllib.error.HTTPError as exc:
            body = json.load(exc)
        if body.get("status") != "success":
            raise RuntimeError(f"{path} {params}: {body.get('errorType')}: {body.get('error')}")
        return body["data"]

    def query(self, expr: str) -> list[dict[str, Any]]:
        """Instant query; the result vector (``[{"metric": {...}, "value": [t, "v"]}]``)."""
        data = self.api("query", query=expr)
        return data["result"] if data["resultType"] == "vector" else [data]

    def targets(self) -> list[dict[str, Any]]:
        return self.api("targets", state="active")["activeTargets"]

    def alerts(self) -> list[dict[str, Any]]:
        return self.api("alerts")["alerts"]

    def alert_state(self, name: str, **labels: str) -> str:
        """``firing``, ``pending`` or ``inactive`` (no such alert) for alert ``name`` with
        ``labels``."""
        states = {a["state"] for a in self.alerts() if a["labels"].get("alertname") == name
                  and all(a["labels"].get(k) == v for k, v in labels.items())}
        return "firing" if "firing" in states else "pending" if states else "inactive"


def selectors(expr: str) -> list[str]:
    """The vector selectors (metric name and matchers) of a kvbridge alert or panel query."""
    return [m.group(0) for m in re.finditer(r"\b(kvbridge_[a-z_]+|up)\b(\{[^}]*\})?", expr)]


def signal(expr: str) -> str | None:
    """An alert expression without its final threshold (``X > 0.1`` -> ``X``; ``absent(X)``
    -> ``X``): what must return data while things are healthy. None for compound ones: a
    set operation (``A > 0 unless B``) is empty while things are healthy by design."""
    e = " ".join(expr.split())
    if re.search(r"\s(?:unless|and|or)\s", e):
        return None
    m = re.fullmatch(r"absent\((.*)\)", e)
    if m:
        return m.group(1)
    m = re.fullmatch(r"(.*\S)\s*(?:>|==|<)\s*[0-9.]+", e)
    return m.group(1) if m else None


def counts_by_label(collector: Any, sample: str, label: str) -> Counter[str]:
    """In-process counter samples named ``sample`` of a prometheus_client ``collector``,
    summed by the value of ``label`` (a test's view of, say, requests by outcome)."""
    out: Counter[str] = Counter()
    for metric in collector.collect():
        for s in metric.samples:
            if s.name == sample:
                out[s.labels[label]] += int(s.value)
    return out
