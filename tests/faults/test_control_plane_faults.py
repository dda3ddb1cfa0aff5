"""Faults on the real control plane: kube-apiserver and etcd restarts, the operator SIGKILLed
between status writes, an agent cut off from the apiserver, and watches that expire (410 Gone).

After each fault the same checks: the stored statuses equal what the planner derives from the
stored objects (``faultlib.divergence``), the KVEndpoints are exactly the ones created (none
lost, none duplicated, none ownerless, no peer that is not stored), a KVTransfer deleted
during or after the fault disappears (its finalizer is not stuck), and the real agents still
pull verified bytes from every peer the operator assigned them.
"""

from __future__ import annotations

import itertools
import random
import signal
import time
from collections.abc import Callable, Iterable, Sized

import pytest
from faultlib import NS, SEED, Agents, compact_etcd, divergence, endpoint_census

from kvbridge_operator.config import ENDPOINTS, TRANSFERS
from kvbridge_operator.reconciler import RELEASE_RETRY_DELAYS
from kvbridge_testkit.e2e import Api, wait_for
from kvbridge_testkit.operator_process import OperatorProcess
from kvbridge_testkit.sim import SimPod

pytestmark = [pytest.mark.k8s, pytest.mark.nixl, pytest.mark.slow, pytest.mark.faults]

LOCAL = [[1, 2, 3, 4], [10, 11]]
REMOTE = [[20, 21, 22, 23], [40, 63]]
_requests = itertools.count()
#: kopf's debug line for a watch answered 410 Gone (then it lists again).
RELISTED = "Restarting the watch-stream for kvendpoints"


# -- checks ----------------------------------------------------------------------------------
def until_none(fn: Callable[[], Sized], timeout: float, what: str) -> None:
    """Poll ``fn`` until it returns nothing (no problems); fail with the last problems."""
    deadline = time.monotonic() + timeout
    problems: Sized = ()
    while time.monotonic() < deadline:
        problems = fn()
        if not problems:
            return
        time.sleep(0.3)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}; still: {problems}")


def converge(api: Api, transfer: str, timeout: float = 90.0) -> None:
    """Wait until ``transfer``'s statuses are the planner's truth; fail with the difference."""
    until_none(lambda: divergence(api, NS, transfer), timeout, f"{transfer} statuses converge")


def assert_endpoints(api: Api, expected: set[str]) -> None:
    assert set(api.endpoints(NS)) == expected
    assert endpoint_census(api, NS) == []


def assert_transfers_work(api: Api, agents: Agents) -> None:
    """``d-0`` pulls verified bytes from every prefill engine the operator assigned it, and
    its KVEndpoint reports those handshakes (the agent is in sync with the apiserver)."""
    d = agents.decode
    peers = {p["name"]: p for p in api.endpoint(NS, "d-0")["status"]["peers"]}
    assert peers, "the operator assigned d-0 no peer"

    def synced() -> bool:
        reported = api.endpoint(NS, "d-0")["status"].get("handshakes") or []
        return d.status()["peers"] == {n: p["epoch"] for n, p in peers.items()} and sorted(
            (h["peer"], h["epoch"], h["state"]) for h in reported
        ) == sorted((n, p["epoch"], "Succeeded") for n, p in peers.items())

    wait_for(synced, timeout=60, what=f"d-0 handshaken with {sorted(peers)} and reported")
    for p in peers.values():
        rid = f"r{next(_requests)}"
        agents.pods[p["name"]].call("hold", request_ids=[rid])
        d.call("clear")
        res = d.call("pull", request_id=rid, remote_engine_id=p["engineId"],
                     local_block_ids=LOCAL, remote_block_ids=REMOTE, verify_seed=SEED,
                     timeout_s=5.0)  # fmt: skip
        assert res["ok"] and res["verified"], (p["name"], res)


def sync_failures(agent: SimPod) -> int:
    """How often the agent's KVEndpoint sync has failed (its log)."""
    return agent.log_path.read_text(errors="replace").count("sync failed")


def assert_deleted(api: Api, transfer: str, endpoints: Iterable[str]) -> None:
    """The KVTransfer goes (finalizer ran) and its endpoints say so."""
    wait_for(lambda: transfer not in {t["metadata"]["name"] for t in api.list(TRANSFERS, NS)},
             timeout=60, what=f"KVTransfer {transfer} gone")  # fmt: skip

    def unreleased() -> dict[str, dict]:
        stored = api.endpoints(NS)
        statuses = {n: stored[n].get("status") or {} for n in endpoints}
        return {n: s for n, s in statuses.items()
                if s.get("reason") != "TransferDeleted" or s.get("peers")}  # fmt: skip

    until_none(unreleased, 60, f"endpoints of {transfer} released")


# -- load: engines without agents, in a KVTransfer of their own --------------------------------
class Load:
    """Fake engines (Pod + KVEndpoint written as an admin) of one KVTransfer."""

    def __init__(self, api: Api, transfer: str) -> None:
        self.api, self.transfer = api, transfer
        self.names: set[str] = set()
        self._ids = itertools.count()
        api.create_transfer(NS, transfer, pairing={"prefillPerDecode": 2})

    def add(self, role: str) -> str:
        engine = f"{self.transfer}-{role[0]}{next(self._ids)}"
        (name,) = self.api.start_engine(NS, engine, role, transfer=self.transfer)
        self.names.add(name)
        return name

    def remove(self, name: str) -> None:
        self.api.delete(ENDPOINTS, NS, name)
        self.api.delete_pods(NS, [name])
        self.names.discard(name)

    def remove_all(self) -> None:
        for name in sorted(self.names):
            self.remove(name)
        wait_for(lambda: not (self.names & set(self.api.endpoints(NS))), timeout=30,
                 what=f"endpoints of {self.transfer} deleted")  # fmt: skip

    def handshakes(self) -> int:
        return self.api.report_handshakes(NS, sorted(self.names))


def all_endpoints(agents: Agents, *loads: Load) -> set[str]:
    return set(agents.pods).union(*(load.names for load in loads))


def while_busy(api: Api, transfer: str, change: Callable[[], object], fault: Callable[[], None],
               attempts: int = 5) -> None:  # fmt: skip
    """Make ``change``, then inject ``fault`` while the operator has not yet written all it
    implies (checked, so the fault really lands mid-reconcile)."""
    for _ in range(attempts):
        change()
        if divergence(api, NS, transfer):
            fault()
            return
    raise AssertionError(f"the operator always caught up before the fault ({attempts} tries)")


# -- the faults -------------------------------------------------------------------------------
def test_watch_expired_410_relists_and_forgets_what_was_deleted(
    cluster, api: Api, operator: OperatorProcess, agents: Agents
) -> None:
    """The operator is frozen, the apiserver restarted (its watches break), endpoints deleted
    and etcd compacted: its watches resume from a compacted resourceVersion, get 410 Gone and
    relist. Deletions it never saw as events must not live on in its plans."""
    load = Load(api, "load-e")
    for role in ("prefill", "prefill", "prefill", "decode", "decode"):
        load.add(role)
    converge(api, "load-e")
    load.handshakes()
    converge(api, "load-e")
    gone = sorted(n for n in load.names if "-p" in n)[:2]
    restarts_before = operator.logs().count(RELISTED)

    operator.pause()
    try:
        # The restart closes the frozen operator's watches: what follows reaches it only by a
        # new watch (or list), never from a socket buffer filled before it froze.
        cluster.restart("kube-apiserver")
        for name in gone:
            load.remove(name)
        compact_etcd(cluster.etcd_url)
    finally:
        operator.resume()
    wait_for(lambda: operator.logs().count(RELISTED) > restarts_before,
             timeout=60, what="a watch answered 410 Gone and restarted (operator log)")
    converge(api, "load-e")
    converge(api, "kvt")
    assert_endpoints(api, all_endpoints(agents, load))
    assert_transfers_work(api, agents)
    names = set(load.names)
    api.delete(TRANSFERS, NS, "load-e")
    assert_deleted(api, "load-e", names)
    load.remove_all()


def test_apiserver_restart_mid_reconcile(cluster, api: Api, operator: OperatorProcess,
                                         agents: Agents) -> None:  # fmt: skip
    """kube-apiserver restarted while the operator still has statuses to write, and again
    right after a KVTransfer deletion (its finalizer must still run). A restarting apiserver
    answers 404 for custom resources for a moment; kopf alone would stop the operator."""
    load = Load(api, "load-a")
    for role in ("prefill", "prefill", "decode", "decode"):
        load.add(role)
    converge(api, "load-a")

    def change() -> None:
        load.add("decode")
        load.handshakes()

    while_busy(api, "load-a", change, lambda: cluster.restart("kube-apiserver", down_s=1.0))
    converge(api, "load-a")
    # Events flow again: a change after the restart is planned.
    load.remove(sorted(n for n in load.names if "-p" in n)[0])
    load.add("prefill")
    converge(api, "load-a")
    converge(api, "kvt")
    assert_endpoints(api, all_endpoints(agents, load))
    assert_transfers_work(api, agents)
    # The finalizer runs even when the apiserver restarts right after the deletion, and stays
    # down longer than the release retries its writes: the release waits for it rather than
    # letting the finalizer go with the endpoints untold.
    names = set(load.names)
    api.delete(TRANSFERS, NS, "load-a")
    cluster.restart("kube-apiserver", down_s=sum(RELEASE_RETRY_DELAYS) + 1.0)
    assert_deleted(api, "load-a", names)
    load.remove_all()


def test_etcd_restart_keeps_data(cluster, api: Api, operator: OperatorProcess,
                                 agents: Agents) -> None:  # fmt: skip
    """etcd killed (SIGKILL, data directory kept) mid-reconcile and right after a deletion."""
    load = Load(api, "load-b")
    for role in ("prefill", "prefill", "decode", "decode"):
        load.add(role)
    converge(api, "load-b")
    kept = {n: e["metadata"]["uid"] for n, e in api.endpoints(NS).items()}

    def change() -> None:
        load.add("decode")
        load.handshakes()

    while_busy(api, "load-b", change,
               lambda: cluster.restart("etcd", sig=signal.SIGKILL, down_s=2.0))
    stored = {n: e["metadata"]["uid"] for n, e in api.endpoints(NS).items()}
    assert {n: stored.get(n) for n in kept} == kept, "etcd lost or replaced KVEndpoints"
    converge(api, "load-b")
    load.remove(sorted(n for n in load.names if "-d" in n)[0])
    load.add("decode")
    converge(api, "load-b")
    converge(api, "kvt")
    assert_endpoints(api, all_endpoints(agents, load))
    assert_transfers_work(api, agents)
    names = set(load.names)
    api.delete(TRANSFERS, NS, "load-b")
    cluster.restart("etcd", sig=signal.SIGKILL)
    assert_deleted(api, "load-b", names)
    load.remove_all()


def test_operator_sigkill_between_status_writes(cluster, api: Api, operator: OperatorProcess,
                                                agents: Agents) -> None:  # fmt: skip
    """Eight kill -9 at seeded random moments after a change (within the operator's debounce
    and writes, see conftest), each followed by a restart."""
    rng = random.Random(1203)
    load = Load(api, "load-c")
    for role in ("prefill", "prefill", "decode"):
        load.add(role)
    doomed: list[tuple[str, set[str]]] = []
    undone: list[int] = []
    for round_ in range(8):
        action = rng.choice(["add-decode", "add-prefill", "remove", "spec", "delete-transfer"])
        if action == "add-decode":
            load.add("decode")
        elif action == "add-prefill":
            load.add("prefill")
        elif action == "remove" and len(own := sorted(n for n in load.names
                                                      if n.startswith("load-c-"))) > 2:
            load.remove(rng.choice(own))
        elif action == "spec":
            api.patch(TRANSFERS, NS, "load-c",
                      {"spec": {"pairing": {"prefillPerDecode": rng.choice([1, 2, 3])}}})
        elif action == "delete-transfer":
            extra = Load(api, f"load-c{round_}")
            extra.add("prefill")
            extra.add("decode")
            api.delete(TRANSFERS, NS, extra.transfer)
            doomed.append((extra.transfer, set(extra.names)))
            load.names |= extra.names
        load.handshakes()
        time.sleep(rng.uniform(0.0, 0.5))
        operator.kill()
        # Dead, the operator writes nothing more: what differs now it left undone.
        undone.append(len(divergence(api, NS, "load-c")))
        operator.start()
    assert any(undone), f"no kill landed before the operator had caught up: {undone}"
    converge(api, "load-c")
    converge(api, "kvt")
    for transfer, names in doomed:
        assert_deleted(api, transfer, names)
    assert_endpoints(api, all_endpoints(agents, load))
    assert_transfers_work(api, agents)
    names = set(load.names)
    api.delete(TRANSFERS, NS, "load-c")
    time.sleep(rng.uniform(0.0, 0.3))
    operator.kill()
    operator.start()
    assert_deleted(api, "load-c", {n for n in names if n.startswith("load-c-")})
    load.remove_all()


def test_agent_cut_off_keeps_transferring_and_resyncs(cluster, api: Api, agents: Agents
                                                      ) -> None:  # fmt: skip
    d = agents.decode
    assert_transfers_work(api, agents)
    failures = sync_failures(d)
    agents.proxy.cut()
    try:
        # A new prefill engine appears; the operator assigns it to d-0, which cannot see it.
        agents.start("p-1", "prefill", "P1")
        wait_for(lambda: "p-1" in {p["name"] for p in api.endpoint(NS, "d-0")["status"]["peers"]},
                 timeout=60, what="operator assigns p-1 to d-0")  # fmt: skip
        # Transfers with the last-known peer keep working while cut off.
        agents.pods["p-0"].call("hold", request_ids=["cut-1"])
        d.call("clear")
        res = d.call("pull", request_id="cut-1", remote_engine_id="P0", local_block_ids=LOCAL,
                     remote_block_ids=REMOTE, verify_seed=SEED, timeout_s=5.0)  # fmt: skip
        assert res["ok"] and res["verified"], res
        wait_for(lambda: agents.proxy.refused >= 2 and sync_failures(d) > failures, timeout=30,
                 what="d-0 tried the apiserver and failed")  # fmt: skip
        assert set(d.status()["peers"]) == {"p-0"}, "d-0 saw the apiserver through the cut"
    finally:
        agents.proxy.restore()
    wait_for(lambda: set(d.status()["peers"]) == {"p-0", "p-1"}, timeout=60,
             what="d-0 resynced its peers")  # fmt: skip
    converge(api, "kvt")
    assert_endpoints(api, set(agents.pods))
    assert_transfers_work(api, agents)


def test_agent_partitioned_keeps_transferring_and_drops_a_gone_peer(
    cluster, api: Api, agents: Agents
) -> None:
    """A partition (requests hang, nothing refused) while a peer goes away: d-0 keeps pulling
    from the peer that is still there and, once healed, drops the one that is gone."""
    d = agents.decode
    assert set(d.status()["peers"]) == {"p-0", "p-1"}
    failures = sync_failures(d)
    agents.proxy.stall()
    try:
        gone = agents.pods.pop("p-1")
        gone.close()
        gone.delete_pod()
        wait_for(lambda: [p["name"] for p in api.endpoint(NS, "d-0")["status"]["peers"]]
                 == ["p-0"], timeout=60, what="operator withdraws p-1 from d-0")  # fmt: skip
        agents.pods["p-0"].call("hold", request_ids=["stall-1"])
        d.call("clear")
        res = d.call("pull", request_id="stall-1", remote_engine_id="P0", local_block_ids=LOCAL,
                     remote_block_ids=REMOTE, verify_seed=SEED, timeout_s=5.0)  # fmt: skip
        assert res["ok"] and res["verified"], res
        wait_for(lambda: agents.proxy.held >= 1, timeout=30, what="d-0 tried the apiserver")
        # Held long enough for d-0's requests to time out (10 s), not just to wait.
        wait_for(lambda: sync_failures(d) > failures, timeout=60, what="d-0's sync timed out")
        assert set(d.status()["peers"]) == {"p-0", "p-1"}, "d-0 saw the apiserver through it"
    finally:
        agents.proxy.restore()
    wait_for(lambda: set(d.status()["peers"]) == {"p-0"}, timeout=60,
             what="d-0 resynced and dropped p-1")  # fmt: skip
    converge(api, "kvt")
    assert_endpoints(api, set(agents.pods))
    assert_transfers_work(api, agents)
