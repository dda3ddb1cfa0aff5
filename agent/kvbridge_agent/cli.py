"""The ``kvbridge`` command line. Subcommands register themselves in :data:`SUBCOMMANDS`.

Exit status (all subcommands): 0 success; 1 the remote is incompatible; 2 usage or input-file
error; 3 timeout or connection failure; 4 undecodable or mismatching handshake (connector
version, hash, engine id); 5 the remote rejected the request. Failures print one line,
``kvbridge <cmd>: <reason>``, on stderr.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import msgspec

from . import __version__, rules
from .drain import add_drain_command
from .errors import KVBridgeError
from .protocol import (
    NIXL_CONNECTOR_VERSION,
    EngineGeometry,
    NixlAgentMetadata,
    ProtocolError,
    check_metadata,
    validate_remote,
)
from .sidechannel import (
    DEFAULT_TIMEOUT_S,
    HandshakeResult,
    RemoteRejectedError,
    SideChannelError,
    fetch_metadata,
)

EXIT_OK, EXIT_INCOMPATIBLE, EXIT_USAGE, EXIT_UNREACHABLE, EXIT_PROTOCOL, EXIT_REJECTED = range(6)

GEOMETRY_HELP = """\
--geometry FILE is JSON describing the local engine, checked against every fetched rank with
the same rules the handshake and the operator use (kvbridge_agent.protocol.validate_remote).
Keys: engine_id, tp_size, block_size (kernel tokens), num_blocks (kernel blocks),
kv_cache_layout, and per-region data, either as flat lists (block_lens, block_strides,
region_num_blocks, region_group_ids, region_names, region_mem_types) or as
"regions": [{"name", "num_blocks", "group_id", "mem_type", "block_len", "block_stride"}].
Optional: attn_backend_name, physical_blocks_per_logical_kv_block (1), dcp_size (1),
pcp_size (1), is_mla (false), num_kv_heads (total), tp_rank, protocol_version (11),
compatibility_hash, transfer_mode ("pull"|"push"), ssm_sizes. KVEndpoint camelCase spellings
are accepted too (blockSize, tpSize, layout, attentionBackend, physicalBlocksPerLogical,
numBlocks, groupId, memType, blockLen, blockStride, ...). A `kvbridge probe --json` metadata
object plus "tp_size" and "is_mla" is a valid file. Unknown keys are an error.
"""


class CliFailure(KVBridgeError):
    """A command cannot go on: the exit code and the reason printed."""

    def __init__(self, code: int, reason: str) -> None:
        super().__init__(reason)
        self.code = code


def _parse_ranks(text: str) -> list[int]:
    ranks: list[int] = []
    try:
        for part in text.split(","):
            lo, _, hi = part.partition("-")
            ranks.extend(range(int(lo), int(hi or lo) + 1))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected ranks like 0 or 0,2 or 0-3, got {text!r}"
        ) from None
    if not ranks or min(ranks) < 0:
        raise argparse.ArgumentTypeError(f"expected non-negative ranks, got {text!r}")
    return ranks


def _parse_target(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise argparse.ArgumentTypeError(f"expected HOST:PORT (e.g. 10.0.0.5:5600), got {text!r}")
    return host.strip("[]"), int(port)


def _jsonable(meta: NixlAgentMetadata) -> dict[str, Any]:
    """Spec field names and order; ``agent_metadata`` as hex."""
    return msgspec.to_builtins(meta) | {"agent_metadata": meta.agent_metadata.hex()}


def _add_probe(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "probe",
        help="fetch, decode and check a remote engine's v11 handshake metadata",
        description="Query a vLLM/kvbridge NIXL side channel (spec §1.1) for the v11 metadata\n"
        "of the given (pp, tp) ranks, print it, check that each rank's metadata is consistent\n"
        "with itself (per-region lists of one length, strides covering blocks, capacities,\n"
        "memory types, unique names), and optionally check it against a local geometry.",
        epilog=GEOMETRY_HELP + "\nExit status: 0 ok, 1 incompatible, 2 usage/input error, "
        "3 timeout/unreachable, 4 decode/connector-version/hash/engine-id error or broken "
        "(self-inconsistent) metadata, 5 rejected by the remote.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "target",
        type=_parse_target,
        metavar="HOST:PORT",
        help="side-channel address (port = VLLM_NIXL_SIDE_CHANNEL_PORT + DP index)",
    )
    p.add_argument(
        "--pp",
        type=_parse_ranks,
        default=[0],
        metavar="RANKS",
        help="remote PP rank(s) to query: 0, 0,1 or 0-3 (default 0)",
    )
    p.add_argument(
        "--tp",
        type=_parse_ranks,
        default=[0],
        metavar="RANKS",
        help="remote TP rank(s) to query: 0, 0,1 or 0-3 (default 0)",
    )
    p.add_argument(
        "--timeout",
        type=float,
        default=DEFAULT_TIMEOUT_S,
        metavar="S",
        help=f"deadline for all queries, seconds (default {DEFAULT_TIMEOUT_S:g})",
    )
    p.add_argument("--json", action="store_true", help="print JSON (spec field names, bytes hex)")
    p.add_argument(
        "--geometry",
        type=Path,
        metavar="FILE",
        help="local engine geometry JSON to validate the remote against (below)",
    )
    p.add_argument(
        "--expect-hash",
        metavar="H",
        help="local compatibility hash; a different remote hash fails (exit 4)",
    )
    p.add_argument("--engine-id", metavar="ID", help="expected remote engine id (exit 4 if not)")
    p.add_argument(
        "--remote-tp-size",
        type=int,
        metavar="N",
        help="remote TP size for --geometry checks (default: the local tp_size)",
    )
    p.add_argument(
        "--mode",
        choices=rules.MODES,
        help="transfer mode for --geometry checks (default: the file's, else pull)",
    )
    p.set_defaults(func=_probe)


def _probe(args: argparse.Namespace) -> int:
    local = _load_geometry(args.geometry) if args.geometry else None
    host, port = args.target
    targets = [(pp, tp) for pp in args.pp for tp in args.tp]
    try:
        result = fetch_metadata(
            host,
            port,
            targets,
            timeout_s=args.timeout,
            local_hash=args.expect_hash,
            expected_engine_id=args.engine_id,
        )
    except RemoteRejectedError as exc:
        raise CliFailure(EXIT_REJECTED, str(exc)) from exc
    except SideChannelError as exc:
        raise CliFailure(EXIT_UNREACHABLE, str(exc)) from exc
    except ProtocolError as exc:
        raise CliFailure(EXIT_PROTOCOL, str(exc)) from exc
    broken = {(r.pp_rank, r.tp_rank): check_metadata(r.metadata) for r in result.replies}
    verdicts = _check(result, local, args) if local is not None else None
    if args.json:
        print(json.dumps(_probe_json(result, broken, verdicts), indent=2))
    else:
        _print_human(result, broken, verdicts)
    _fail_on_first(broken, EXIT_PROTOCOL, "broken metadata", result.endpoint)
    _fail_on_first(verdicts or {}, EXIT_INCOMPATIBLE, "incompatible", result.endpoint)
    return EXIT_OK


def _fail_on_first(verdicts: dict, code: int, what: str, endpoint: str) -> None:
    """Raise the probe's one-line failure for the first rank whose verdict is not ok."""
    bad = [(rank, v) for rank, v in verdicts.items() if not v.ok]
    if bad:
        (pp, tp), verdict = bad[0]
        more = f" (and {len(bad) - 1} more rank(s))" if len(bad) > 1 else ""
        raise CliFailure(code, f"{what}: rank (pp {pp}, tp {tp}) of {endpoint}: "
                               f"{verdict.summary(limit=3)}{more}")


def _load_geometry(path: Path) -> EngineGeometry:
    try:
        data = json.loads(path.read_text())
        if not isinstance(data, dict):
            raise ValueError("expected a JSON object")
        return EngineGeometry.from_dict(data)
    except (OSError, ValueError, TypeError) as exc:
        raise CliFailure(EXIT_USAGE, f"--geometry {path}: {exc}") from exc


def _check(result: HandshakeResult, local: EngineGeometry, args: argparse.Namespace) -> dict:
    verdicts = {}
    first = result.replies[0].metadata.num_blocks
    for r in result.replies:
        remote = EngineGeometry.from_metadata(
            r.metadata,
            tp_size=args.remote_tp_size or local.tp_size,
            is_mla=local.is_mla,
            num_kv_heads=local.num_kv_heads,
            tp_rank=r.tp_rank,
            protocol_version=NIXL_CONNECTOR_VERSION if r.metadata.is_v11 else 10,
            compatibility_hash=r.payload.compatibility_hash,
        )
        verdicts[(r.pp_rank, r.tp_rank)] = validate_remote(
            local,
            remote,
            mode=args.mode or local.transfer_mode or "pull",
            expected_engine_id=args.engine_id,
            expected_num_blocks=first,
        )
    return verdicts


def _probe_json(result: HandshakeResult, broken: dict, verdicts: dict | None
                ) -> dict[str, Any]:  # fmt: skip
    ranks = []
    for r in result.replies:
        entry: dict[str, Any] = {
            "pp_rank": r.pp_rank,
            "tp_rank": r.tp_rank,
            "rtt_s": r.rtt,
            "clock_offset_s": r.clock_offset,
            "compatibility_hash": r.payload.compatibility_hash,
            "metadata": _jsonable(r.metadata),
        }
        consistency = broken[(r.pp_rank, r.tp_rank)]
        entry["consistency"] = {"ok": consistency.ok, "problems": consistency.to_dicts()}
        if verdicts is not None:
            v = verdicts[(r.pp_rank, r.tp_rank)]
            entry["verdict"] = {"ok": v.ok, "problems": v.to_dicts()}
        ranks.append(entry)
    return {
        "endpoint": result.endpoint,
        "protocol_version": NIXL_CONNECTOR_VERSION,
        "clock_offset_s": result.clock_offset,
        "ranks": ranks,
    }


def _print_human(result: HandshakeResult, broken: dict, verdicts: dict | None) -> None:
    print(
        f"{result.endpoint}: {len(result.replies)} rank(s), best RTT "
        f"{result.best.rtt * 1e3:.3f} ms, clock offset {result.clock_offset * 1e3:+.3f} ms"
    )
    for r in result.replies:
        m = r.metadata
        print(
            f"\n[pp {r.pp_rank}, tp {r.tp_rank}] engine {m.engine_id!r}  "
            f"{'v11' if m.is_v11 else 'v10 (no per-region fields)'}  "
            f"hash {r.payload.compatibility_hash}"
        )
        print(
            f"  device_id {m.device_id}  num_blocks {m.num_blocks}  block_size {m.block_size}  "
            f"ppl {m.physical_blocks_per_logical_kv_block}  layout {m.kv_cache_layout}  "
            f"backend {m.attn_backend_name}  dcp {m.dcp_size}  pcp {m.pcp_size}  "
            f"ssm {tuple(m.ssm_sizes)}  agent_metadata {len(m.agent_metadata)} B"
        )
        print(
            f"  {'#':>3}  {'name':<40} {'mem':<5} {'group':>5} {'blocks':>8} "
            f"{'block_len':>10} {'stride':>10}  base"
        )
        for i, addr in enumerate(m.kv_caches_base_addr):
            print(
                f"  {i:>3}  {_at(m.region_names, i):<40} {_at(m.region_mem_types, i):<5} "
                f"{_at(m.region_group_ids, i):>5} {_at(m.region_num_blocks, i):>8} "
                f"{_at(m.block_lens, i):>10} {_at(m.block_strides, i):>10}  {addr:#x}"
            )
        consistency = broken[(r.pp_rank, r.tp_rank)]
        print("  metadata: " + ("consistent" if consistency.ok
                                else f"BROKEN, {len(consistency.problems)} problem(s)"))
        for p in consistency.problems:
            print(f"    - [{p.rule}] {p.message}")
        if verdicts is not None:
            v = verdicts[(r.pp_rank, r.tp_rank)]
            print(
                "  geometry check: " + ("compatible" if v.ok else f"{len(v.problems)} problem(s)")
            )
            for p in v.problems:
                print(f"    - [{p.rule}] {p.message}")


def _at(values: Sequence[Any] | None, i: int) -> str:
    return "-" if values is None or i >= len(values) else str(values[i])


def _write_test_model(args: argparse.Namespace) -> int:
    from ._testmodel import write_test_model

    try:
        out = write_test_model(args.directory, seed=args.seed)
    except OSError as exc:
        raise CliFailure(EXIT_USAGE, f"cannot write {args.directory}: {exc}") from exc
    print(out)
    return EXIT_OK


def _add_write_test_model(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "write-test-model",
        help="write a tiny Llama with seeded random weights (for tests and demos only)",
        description="Write a 2-layer Llama checkpoint (float32, seeded random weights, a\n"
        "byte-level tokenizer with a chat template) that vLLM serves without any download.\n"
        "The same seed writes the same bytes everywhere, so pods that each write their own\n"
        "copy serve one model. It exists for tests and demos: its answers are noise, but\n"
        "a P/D transfer that delivered wrong KV changes them. Real pods mount their model.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("directory", type=Path, help="where to write it (created if missing)")
    p.add_argument("--seed", type=int, default=0, help="weights' random seed (default 0)")
    p.set_defaults(func=_write_test_model)


def _fingerprint(args: argparse.Namespace) -> int:
    from .identity import fingerprint

    try:
        fp = fingerprint(args.directory, "full" if args.full else "sampled")
    except OSError as exc:
        raise CliFailure(EXIT_USAGE, f"cannot read {args.directory}: {exc}") from exc
    if not fp.files:
        raise CliFailure(EXIT_USAGE, f"{args.directory}: no weight, tokenizer or config file")
    print(fp.value)
    print(f"files: {fp.files}  bytes read: {fp.bytes_read}  seconds: {fp.seconds:.3f}")
    return EXIT_OK


def _add_fingerprint(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "fingerprint",
        help="print the content fingerprint of a model directory (KVEndpoint spec.model)",
        description="Print the fingerprint a kvbridge connector publishes for the model in\n"
        "DIRECTORY (its weight, tokenizer and config files), then the file count, the bytes\n"
        "read and the seconds it took. The default, sampled-v1, reads names, sizes,\n"
        "safetensors headers and sampled chunks of every file: it misses a change confined\n"
        "to unsampled bytes. --full (full-v1) digests every byte. Compare two pods' models\n"
        "with it: equal fingerprints are what the operator pairs.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("directory", type=Path, help="the model directory")
    p.add_argument("--full", action="store_true",
                   help="digest every byte (full-v1) instead of sampling (sampled-v1)")
    p.set_defaults(func=_fingerprint)


SUBCOMMANDS: list[Callable[[argparse._SubParsersAction], None]] = [
    _add_probe, _add_write_test_model, _add_fingerprint, add_drain_command]
"""Each entry adds one subparser and sets ``func(args) -> int`` as its default."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvbridge",
        description="kvbridge: vLLM-compatible NIXL (connector v11) KV-transfer tools.",
    )
    parser.add_argument(
        "--version",
        action="version",
        version=f"kvbridge {__version__} (NIXL connector version {NIXL_CONNECTOR_VERSION})",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for add in SUBCOMMANDS:
        add(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except CliFailure as exc:
        print(f"kvbridge {args.command}: {exc}", file=sys.stderr)
        return exc.code
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
