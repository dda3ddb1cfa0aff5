"""What the engine tests ask of vLLM's worker processes, one function per command.

``vllm_engine.py`` sends these functions to every TP rank's worker with
``LLM.collective_rpc`` (a TP-1 engine runs its worker in-process, a TP-N engine in N worker
processes vLLM spawns). They are pickled by reference, so this module is imported in each
worker (``sys.path`` travels with the spawn), and its globals live there: the
:class:`TransferRecorder` of a rank stays in that rank's process between calls.

Each function takes vLLM's worker wrapper first (``collective_rpc``'s convention) and returns
plain data (it crosses a process boundary).
"""

from __future__ import annotations

import hashlib
import os
import time
from typing import Any

#: this process's recorder (one per worker process; None without a connector)
_RECORDER: TransferRecorder | None = None


def _worker(wrapper: Any) -> Any:
    return getattr(wrapper, "worker", wrapper)


def rank(wrapper: Any) -> int:
    return int(getattr(_worker(wrapper), "rank", 0))


def connector() -> Any:
    """This worker's KV connector (vLLM's facade); RuntimeError without one."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

    if not has_kv_transfer_group():
        raise RuntimeError("no KV connector in this engine (started with --connector none)")
    return get_kv_transfer_group()


def install_recorder(wrapper: Any) -> int:
    """Wrap this rank's connector in a :class:`TransferRecorder` (once per process)."""
    global _RECORDER
    if _RECORDER is None:
        _RECORDER = TransferRecorder(connector())
    return rank(wrapper)


def transfers(wrapper: Any) -> dict[str, Any]:
    """This rank's receives that ended since the last call, and connector seconds."""
    if _RECORDER is None:
        raise RuntimeError("no KV connector in this engine (started with --connector none)")
    return {"rank": rank(wrapper), "transfers": _RECORDER.take(),
            "connector_seconds": {k: {"seconds": v[0], "calls": v[1], "cpu_seconds": v[2]}
                                  for k, v in _RECORDER.spent.items()}}


def dump_profile(_wrapper: Any) -> None:
    if _RECORDER is not None:
        _RECORDER.dump_profile()


def kvbridge_worker() -> Any:
    worker = connector().connector_worker
    if getattr(worker, "service", None) is None:
        raise RuntimeError(f"{type(worker).__name__} is not kvbridge's worker")
    return worker


def connector_state(wrapper: Any) -> dict[str, Any]:
    """kvbridge only: the remote engines this rank's agent has loaded, its epoch."""
    from kvbridge_agent import metrics

    service = kvbridge_worker().service
    return {"rank": rank(wrapper),
            "remotes": sorted({p.engine_id for p in service.peers().values()}),
            "epoch": service.epoch,
            "late_reads_declined": metrics.value("kvbridge_agent_late_reads_declined_total"),
            "model_mismatch_declined": metrics.value("kvbridge_agent_reads_declined_total",
                                                     cause="model_mismatch")}


def preflight(wrapper: Any, engine_id: str, host: str, port: int, tp_size: int
              ) -> dict[str, Any]:  # fmt: skip
    """kvbridge only: this rank handshakes with the prefill ranks it reads from, now."""
    ok, message = kvbridge_worker().preflight(engine_id, host, port, tp_size)
    return {"rank": rank(wrapper), "preflight_ok": ok, "message": message}


def kv_cache_config(wrapper: Any) -> Any:
    return _worker(wrapper).model_runner.kv_cache_config


def kv_caches(wrapper: Any, connector_name: str) -> dict[str, Any]:
    """Layer name -> KV tensor, as the worker connector registered them (else the runner's)."""
    if connector_name == "none":
        runner = _worker(wrapper).model_runner
        ctx = runner.vllm_config.compilation_config.static_forward_context
        return {name: layer.kv_cache for name, layer in ctx.items()
                if hasattr(layer, "kv_cache") and hasattr(layer.kv_cache, "shape")}
    conn = connector()
    worker = getattr(conn, "connector_worker", None)
    for owner, attr in ((worker, "device_kv_caches"), (worker, "kv_caches"),
                        (conn, "kv_caches")):
        caches = getattr(owner, attr, None) if owner is not None else None
        if caches:
            return dict(caches)
    raise RuntimeError(
        f"{type(conn).__name__}: no registered KV caches found (looked for "
        "connector_worker.device_kv_caches, connector_worker.kv_caches, kv_caches)"
    )


def kv_info(wrapper: Any, connector_name: str) -> dict[str, Any]:
    """This rank's KV tensors (shape, strides, dtype, pointer) and KV cache groups."""
    config = kv_cache_config(wrapper)
    return {
        "rank": rank(wrapper),
        "connector_class": type(connector()).__name__ if connector_name != "none" else None,
        "layers": {
            name: {"shape": list(t.shape), "stride": list(t.stride()),
                   "dtype": str(t.dtype).removeprefix("torch."), "data_ptr": t.data_ptr()}
            for name, t in kv_caches(wrapper, connector_name).items()
        },
        "groups": [
            {"layer_names": list(g.layer_names), "spec": type(g.kv_cache_spec).__name__,
             "block_size": g.kv_cache_spec.block_size,
             "sliding_window": getattr(g.kv_cache_spec, "sliding_window", None)}
            for g in config.kv_cache_groups
        ],
        "num_blocks": config.num_blocks,
    }


def kv_blocks(wrapper: Any, connector_name: str, block_ids: list[list[int]],
              layers: list[str] | None, heads: list[int] | None) -> dict[str, Any]:
    """sha256 per layer of the given blocks' bytes on this rank (block dimension 0).

    ``heads`` = ``[start, stop]`` hashes only those KV heads of each block (dimension 1 of
    the CPU layout): what one rank of a TP-N engine holds of a TP-1 engine's block.
    Whole blocks: a partial last block also holds whatever the engine wrote after the prompt
    (decode tokens, stale rows), so only full prompt blocks compare across engines.
    """
    import torch

    caches = kv_caches(wrapper, connector_name)
    wanted = layers or list(caches)
    group_of = {name: gi for gi, g in enumerate(kv_cache_config(wrapper).kv_cache_groups)
                for name in g.layer_names}
    digests: dict[str, str] = {}
    for name in wanted:
        if name not in caches:
            raise KeyError(f"layers: unknown layer {name!r}; known: {sorted(caches)}")
        gi = group_of.get(name, 0)
        if gi >= len(block_ids):
            raise ValueError(f"block_ids: layer {name!r} is in group {gi}, got ids for "
                             f"{len(block_ids)} group(s)")
        tensor = caches[name]
        if heads is not None and not 0 <= heads[0] < heads[1] <= tensor.shape[1]:
            raise ValueError(f"heads: expected [start, stop] within 0..{tensor.shape[1]}, "
                             f"got {heads}")
        h = hashlib.sha256()
        for b in block_ids[gi]:
            block = tensor[int(b)] if heads is None else tensor[int(b)][heads[0]:heads[1]]
            h.update(block.contiguous().view(-1).view(torch.uint8).numpy().tobytes())
        digests[name] = h.hexdigest()
    return {"rank": rank(wrapper), "sha256": digests}


class TransferRecorder:
    """Instrumentation of the worker-side connector (stock or kvbridge alike): for every
    request it receives, the block ids on both sides, when the engine step that first handed
    it to the connector began, and when the connector reported it received (or failed).

    Wraps the two facade methods vLLM's model runner calls every step; the connector's own
    code runs unchanged inside them.
    """

    def __init__(self, connector: Any) -> None:
        self._now = time.perf_counter
        self._open: dict[str, dict[str, Any]] = {}
        self._done: list[dict[str, Any]] = []
        #: per method: wall seconds inside the connector, calls, and the engine thread's CPU
        #: seconds there (thread_time: not inflated when the machine preempts the engine)
        self.spent: dict[str, list[float]] = {"start_load_kv": [0.0, 0, 0.0],
                                              "get_transfer_results": [0.0, 0, 0.0]}
        start_load, results = connector.start_load_kv, connector.get_transfer_results
        #: ``KVB_PROFILE_CONNECTOR=FILE``: cProfile the connector calls, stats dumped at exit
        self.profile_path = os.environ.get("KVB_PROFILE_CONNECTOR")
        self.profile: Any = None
        if self.profile_path:
            import cProfile

            self.profile = cProfile.Profile()

        def start_load_kv(forward_context: Any, **kwargs: Any) -> Any:
            meta = getattr(connector, "_connector_metadata", None)
            new = [r for r in getattr(meta, "reqs_to_recv", {}) if r not in self._open]
            for req_id, req in getattr(meta, "reqs_to_recv", {}).items():
                if req_id not in self._open and req.remote is not None:
                    self._open[req_id] = {
                        "request_id": req_id, "t_start": self._now(),
                        "step_start": self.spent["get_transfer_results"][1],
                        "local_block_ids": [list(map(int, g)) for g in req.local_block_ids],
                        "remote_block_ids": [list(map(int, g)) for g in req.remote.block_ids],
                        "remote_engine_id": req.remote.engine_id}
            t0, c0 = self._now(), time.thread_time()
            if self.profile is not None:
                self.profile.enable()
            try:
                return start_load(forward_context, **kwargs)
            finally:
                if self.profile is not None:
                    self.profile.disable()
                self._spend("start_load_kv", t0, c0)
                for req_id in new:   # the connector CPU of the step that started the load
                    if req_id in self._open:
                        self._open[req_id]["start_cpu_us"] = (time.thread_time() - c0) * 1e6
                        self._open[req_id]["start_wall_us"] = (self._now() - t0) * 1e6

        def get_transfer_results(finished_req_ids: Any) -> Any:
            t0, c0 = self._now(), time.thread_time()
            if self.profile is not None:
                self.profile.enable()
            out = results(finished_req_ids)
            if self.profile is not None:
                self.profile.disable()
            self._spend("get_transfer_results", t0, c0)
            done_cpu_us = (time.thread_time() - c0) * 1e6
            now = self._now()
            done_wall_us = (now - t0) * 1e6
            for req_id in out.finished_recving:
                rec = self._open.pop(req_id, None)
                if rec is not None:
                    rec["seconds"] = now - rec.pop("t_start")
                    # engine steps (get_transfer_results calls) the load took, this one included
                    rec["steps"] = self.spent["get_transfer_results"][1] - rec.pop("step_start")
                    rec["done_cpu_us"] = done_cpu_us
                    rec["done_wall_us"] = done_wall_us
                    rec["failed"] = req_id in out.failed_recving
                    self._done.append(rec)
            return out

        connector.start_load_kv = start_load_kv
        connector.get_transfer_results = get_transfer_results

    def _spend(self, method: str, since: float, cpu_since: float) -> None:
        acc = self.spent[method]
        acc[0] += self._now() - since
        acc[1] += 1
        acc[2] += time.thread_time() - cpu_since

    def take(self) -> list[dict[str, Any]]:
        out, self._done = self._done, []
        return out

    def dump_profile(self) -> None:
        if self.profile is not None and self.profile_path:
            self.profile.dump_stats(self.profile_path)
