"""Operator load helpers, shared by tests/e2e/test_operator_load.py and
bench/bench_operator_load.py: a fleet of KVEndpoints, an epoch flapper that plays restarting
agents, the converged state checked against the truth, and counts read from the API server's
and the operator's own /metrics.

:func:`fleet` and :func:`convergence_problems` are pure; the rest does I/O.
"""

from __future__ import annotations

import queue
import random
import ssl
import threading
import time
import urllib.request
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from kvbridge_operator import testing as manifests
from kvbridge_operator.config import ENDPOINTS, GROUP, TRANSFERS, VERSION

#: (prefill TP, decode TP) of successive KVTransfers: a mix of TP 1 and TP 2 on both sides.
TP_MIX = ((2, 1), (1, 1), (1, 2), (2, 2))


# -- the fleet (pure) --------------------------------------------------------------------------
def fleet(n_endpoints: int, n_transfers: int) -> tuple[list[dict], list[dict]]:
    """KVTransfers ``kvt-0..`` and about ``n_endpoints`` KVEndpoints split evenly among them,
    a third of each share prefill (engines of the transfer's TP sizes, one prefill engine per
    decode engine at most). Returns (transfer manifests, endpoint manifests)."""
    if n_transfers < 1 or n_endpoints < 4 * n_transfers:
        raise ValueError(
            f"n_endpoints: expected at least 4 per KVTransfer ({n_transfers}), got {n_endpoints}"
        )
    transfers, endpoints = [], []
    for t in range(n_transfers):
        name = f"kvt-{t}"
        ptp, dtp = TP_MIX[t % len(TP_MIX)]
        transfers.append(manifests.transfer_manifest(name, prefill_tp=ptp, decode_tp=dtp))
        share = n_endpoints // n_transfers + (t < n_endpoints % n_transfers)
        n_prefill = max(1, share // 3 // ptp)
        n_decode = max(1, (share - n_prefill * ptp) // dtp)
        for i in range(n_prefill):
            endpoints += manifests.engine_manifests(f"t{t}-p{i:04d}", "prefill", ptp, transfer=name)
        for i in range(n_decode):
            endpoints += manifests.engine_manifests(f"t{t}-d{i:04d}", "decode", dtp, transfer=name)
    return transfers, endpoints


# -- the truth (pure) --------------------------------------------------------------------------
def convergence_problems(transfers: Iterable[Mapping[str, Any]],
                         endpoints: Iterable[Mapping[str, Any]],
                         epochs: Mapping[str, int]) -> list[str]:  # fmt: skip
    """What keeps the stored objects from being converged (empty when converged).

    Converged: every KVEndpoint's ``spec.epoch`` is the one last published (``epochs``) and its
    ``status.observedEpoch`` equals it; every endpoint is Paired; every peer listed exists, has
    the other role, is listed back, and is listed at its current epoch; a decode engine's ranks
    share one prefill engine; each KVTransfer's status is for its generation and counts exactly
    the endpoints, engines and pairs stored.
    """
    problems: list[str] = []
    by_name = {e["metadata"]["name"]: e for e in endpoints}
    if missing := sorted(set(epochs) - set(by_name)):
        problems.append(f"{len(missing)} KVEndpoints missing, e.g. {missing[0]}")
    peers_of: dict[str, set[str]] = {}
    prefill_engine_of: dict[tuple[str, str], set[str]] = {}
    for name, e in by_name.items():
        spec, st = e["spec"], e.get("status") or {}
        if name in epochs and spec["epoch"] != epochs[name]:
            problems.append(f"{name}: spec.epoch {spec['epoch']}, published {epochs[name]}")
        if st.get("observedEpoch") != spec["epoch"]:
            problems.append(f"{name}: observedEpoch {st.get('observedEpoch')} != {spec['epoch']}")
        if st.get("state") != "Paired":
            problems.append(f"{name}: state {st.get('state')} ({st.get('reason')})")
        peers = st.get("peers") or []
        peers_of[name] = {p["name"] for p in peers}
        for p in peers:
            other = by_name.get(p["name"])
            if other is None:
                problems.append(f"{name}: peer {p['name']} does not exist")
            elif other["spec"]["role"] == spec["role"]:
                problems.append(f"{name}: peer {p['name']} has the same role")
            elif p["epoch"] != other["spec"]["epoch"]:
                problems.append(
                    f"{name}: peer {p['name']} at epoch {p['epoch']}, "
                    f"current {other['spec']['epoch']}"
                )
        if spec["role"] == "decode":
            key = (spec["transferName"], spec["engineId"])
            prefill_engine_of.setdefault(key, set()).update(p["engineId"] for p in peers)
    for name, peers in peers_of.items():
        for p in peers:
            if name not in peers_of.get(p, set()):
                problems.append(f"{name} lists {p} as a peer, {p} does not list it back")
    for (transfer, engine), prefills in prefill_engine_of.items():
        if len(prefills) != 1:
            problems.append(f"{transfer}: decode engine {engine} peers with {sorted(prefills)}")
    for t in transfers:
        problems += _transfer_problems(t, [e for e in by_name.values()
                                           if e["spec"]["transferName"] == t["metadata"]["name"]])
    return problems


def peer_names(endpoints: Iterable[Mapping[str, Any]]) -> dict[str, set[str]]:
    """Endpoint name -> names of the peers its status lists (who is paired with whom)."""
    return {e["metadata"]["name"]: {p["name"] for p in (e.get("status") or {}).get("peers") or []}
            for e in endpoints}  # fmt: skip


def _transfer_problems(t: Mapping[str, Any], endpoints: list[Mapping[str, Any]]) -> list[str]:
    name, st = t["metadata"]["name"], t.get("status") or {}
    problems = []
    if st.get("observedGeneration") != t["metadata"].get("generation"):
        problems.append(f"{name}: observedGeneration {st.get('observedGeneration')}")
    for role in ("prefill", "decode"):
        mine = [e for e in endpoints if e["spec"]["role"] == role]
        want = {"endpoints": len(mine), "paired": len(mine),
                "engines": len({e["spec"]["engineId"] for e in mine})}  # fmt: skip
        got = {k: (st.get(role) or {}).get(k) for k in want}
        if got != want:
            problems.append(f"{name}: status.{role} {got}, stored {want}")
    decode_engines = {e["spec"]["engineId"] for e in endpoints if e["spec"]["role"] == "decode"}
    pairs = st.get("pairs") or {}
    if pairs.get("total") != len(decode_engines):
        problems.append(f"{name}: pairs.total {pairs.get('total')}, decode engines "
                        f"{len(decode_engines)}")  # fmt: skip
    return problems


# -- reading the cluster -----------------------------------------------------------------------
def list_objects(custom: Any, namespace: str) -> tuple[list[dict], list[dict]]:
    """(KVTransfers, KVEndpoints) in ``namespace``."""
    return (
        custom.list_namespaced_custom_object(GROUP, VERSION, namespace, TRANSFERS)["items"],
        custom.list_namespaced_custom_object(GROUP, VERSION, namespace, ENDPOINTS)["items"],
    )


def apiserver_requests(server: str, token: str) -> Counter[tuple[str, str, str]]:
    """``apiserver_request_total`` from the API server's /metrics, summed over response codes,
    by (resource, subresource, verb): its own count of the requests it served."""
    ctx = ssl.create_default_context()
    ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE
    req = urllib.request.Request(f"{server}/metrics",
                                 headers={"Authorization": f"Bearer {token}"})  # fmt: skip
    with urllib.request.urlopen(req, context=ctx, timeout=30) as resp:
        text = resp.read().decode()
    counts: Counter[tuple[str, str, str]] = Counter()
    for family in text_string_to_metric_families(text):
        if family.name != "apiserver_request":
            continue
        for s in family.samples:
            if s.name == "apiserver_request_total":
                lb = s.labels
                counts[(lb.get("resource", ""), lb.get("subresource", ""), lb["verb"])] += s.value
    return counts


def status_patches(counts: Mapping[tuple[str, str, str], float], resource: str) -> int:
    """Status writes of ``resource`` (PATCH and PUT on its status subresource)."""
    return int(sum(counts.get((resource, "status", verb), 0) for verb in ("PATCH", "UPDATE")))


def operator_samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of an operator /metrics page, by (name, sorted labels)."""
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def operator_value(samples: Mapping[tuple[str, tuple], float], name: str, **labels: str) -> float:
    """Sum of the samples called ``name`` whose labels include ``labels``."""
    return sum(v for (n, lb), v in samples.items()
               if n == name and set(labels.items()) <= set(lb))  # fmt: skip


def memory_kib(pid: int) -> dict[str, int]:
    """VmRSS (resident now) and VmHWM (peak resident) of a process, in KiB."""
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                out[key] = int(value.split()[0])
    return out


# -- the flapper -------------------------------------------------------------------------------
@dataclass
class Flapper:
    """Publishes new epochs (``spec.epoch`` + 1, as a restarted agent does) of endpoints chosen
    at random among ``names`` at ``rate`` per second, ``count`` in all. Each endpoint is always
    patched by the same worker thread, so its epochs reach the API server in order.

    ``epochs`` is the truth: the last epoch published per endpoint (start from the fleet's).
    """

    make_api: Callable[[], Any]  # -> a CustomObjectsApi (one per worker thread)
    namespace: str
    names: list[str]
    epochs: dict[str, int]
    rate: float
    count: int
    workers: int = 4
    seed: int = 12
    sent: int = 0
    flapped: Counter[str] = field(default_factory=Counter)
    errors: list[str] = field(default_factory=list)
    started: float = 0.0
    finished: float = 0.0

    def run(self) -> None:
        """Flap (blocking) until ``count`` patches were sent."""
        rng = random.Random(self.seed)
        queues: list[queue.Queue[tuple[float, str, int] | None]] = [
            queue.Queue() for _ in range(self.workers)
        ]
        slot = {n: i % self.workers for i, n in enumerate(self.names)}
        lock = threading.Lock()
        threads = [threading.Thread(target=self._work, args=(q, lock), daemon=True)
                   for q in queues]  # fmt: skip
        for th in threads:
            th.start()
        self.started = time.monotonic()
        for k in range(self.count):
            name = rng.choice(self.names)
            self.epochs[name] += 1
            self.flapped[name] += 1
            queues[slot[name]].put((self.started + k / self.rate, name, self.epochs[name]))
        for q in queues:
            q.put(None)
        for th in threads:
            th.join()
        self.finished = time.monotonic()
        if self.errors:
            raise RuntimeError(f"{len(self.errors)} epoch patches failed, e.g. {self.errors[0]}")

    def _work(self, q: queue.Queue[tuple[float, str, int] | None], lock: threading.Lock) -> None:
        api = self.make_api()
        while (item := q.get()) is not None:
            at, name, epoch = item
            time.sleep(max(0.0, at - time.monotonic()))
            try:
                api.patch_namespaced_custom_object(
                    GROUP, VERSION, self.namespace, ENDPOINTS, name, {"spec": {"epoch": epoch}}
                )
            except Exception as exc:  # reported by run()
                with lock:
                    self.errors.append(f"{name} epoch {epoch}: {exc}")
                continue
            with lock:
                self.sent += 1

    @property
    def achieved_rate(self) -> float:
        return self.sent / max(self.finished - self.started, 1e-9)
