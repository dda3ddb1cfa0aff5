"""Which UCX transport reaches a peer, from UCX's own protocol tables.

The log under ``data/`` is real output of UCX 1.23.0 (the one nixl-cu12 1.5.1 bundles) on this
machine: agent ``A`` loaded ``B`` (default transports: cma) and ``C`` (``UCX_TLS=tcp``), then
read from each (``UCX_PROTO_INFO=y``, ``UCX_LOG_FILE``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvbridge_agent.nixl._transport import (
    UNKNOWN,
    ProtoTable,
    TransportBook,
    parse_proto_lines,
)
from kvbridge_agent.rules import transport_accepted

LOG = (Path(__file__).parent / "data" / "ucx_proto_info_cma_tcp.txt").read_text().splitlines()


def _tables(config: int, agent: str = "A") -> list[ProtoTable]:
    tables, _ = parse_proto_lines(LOG)
    return [t for t in tables if t.agent == agent and t.config == config]


def test_real_tables_name_each_configuration_and_its_lanes() -> None:
    tables, others = parse_proto_lines(LOG)
    kv = {(t.agent, t.locality, t.config, t.operation): t.lanes for t in tables if t.moves_kv}
    put = "remote memory write by ucp_put* from host memory to host"
    get = "remote memory read by ucp_get*(multi) into host memory from host"
    assert kv[("A", "intra-node", 1, put)] == ("cma/memory",)
    assert kv[("A", "intra-node", 1, get)] == ("cma/memory",)
    assert kv[("A", "intra-node", 2, put)] == ("tcp/lo", "tcp/eth0")
    assert kv[("A", "intra-node", 2, get)] == ("tcp/lo",)  # "software emulation" over tcp
    assert {t.locality for t in tables} == {"self", "intra-node"}
    am = [t for t in tables if t.config == 1 and t.operation.startswith("active message")]
    assert am and all(t.lanes == ("tcp/lo",) for t in am)  # notifications, not KV
    assert others == []


def test_a_peer_is_given_the_configuration_its_load_printed() -> None:
    book = TransportBook()
    book.learn(_tables(0))  # the agent's own (self) tables, printed at creation
    cma = book.transport_for("A", _tables(1))
    assert (cma.name, cma.detail, cma.locality) == ("cma", "cma/memory", "intra-node")
    tcp = book.transport_for("A", _tables(2))
    assert (tcp.name, tcp.detail) == ("tcp", "tcp/lo, tcp/eth0")


def test_a_reused_configuration_is_named_only_when_it_cannot_be_another() -> None:
    book = TransportBook()
    book.transport_for("A", _tables(1))
    again = book.transport_for("A", [])  # nothing printed: it reuses cfg#1, the only one
    assert again.name == "cma"
    book.transport_for("A", _tables(2))
    ambiguous = book.transport_for("A", [])
    assert ambiguous.name == UNKNOWN and not ambiguous.known
    assert "cfg#1: cma/memory" in ambiguous.detail and "cfg#2: tcp/lo" in ambiguous.detail
    assert book.transport_for("other-agent", []).name == UNKNOWN  # nothing known of it


def test_tables_of_another_agent_in_the_process_are_not_taken_for_ours() -> None:
    book = TransportBook()
    mine = book.transport_for("B", _tables(1, agent="A"))
    assert mine.name == UNKNOWN


def test_a_long_agent_name_matches_the_31_characters_ucx_prints() -> None:
    name = "decode-engine-tp0-e1796421496801"  # 32 characters: UCX prints 31 of them
    tables = [ProtoTable(name[:31], "inter-node", 1, "remote memory read by ucp_get*",
                         ("tcp/eth0",))]  # fmt: skip
    got = TransportBook().transport_for(name, tables)
    assert (got.name, got.detail, got.locality) == ("tcp", "tcp/eth0", "inter-node")


def test_lines_around_the_tables_are_kept_and_partial_tables_are_safe() -> None:
    lines = [
        "[1796419362.1] [vm:1:0]   ucp_worker.c:1234 UCX  WARN  something odd",
        *LOG[:3],  # a table cut after its operation line: no rows, no lanes
        "not a UCX line at all",
    ]
    tables, others = parse_proto_lines(lines)
    assert others == [lines[0], "not a UCX line at all"]
    assert [t.lanes for t in tables] == [()]


@pytest.mark.parametrize(("transport", "accepted", "ok"), [
    ("tcp", [], True),
    ("tcp", ["cma"], False),
    ("cma", ["cma", "rc"], True),
    ("rc_mlx5", ["rc"], True),
    ("rc_mlx5", ["rc_verbs"], False),
    ("rcx", ["rc"], False),
    ("cuda_ipc+tcp", ["cuda_ipc"], False),
    ("cuda_ipc+rc_mlx5", ["cuda_ipc", "rc"], True),
    (UNKNOWN, ["cma"], True),
])  # fmt: skip
def test_accepted_transports_match_names_and_families(transport: str, accepted: list[str],
                                                      ok: bool) -> None:  # fmt: skip
    assert transport_accepted(transport, accepted) is ok
