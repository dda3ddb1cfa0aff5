"""What a vLLM engine reports of its own load, from its Prometheus ``/metrics``: pure.

Read: ``vllm:num_requests_running`` and ``vllm:num_requests_waiting`` (requests in its
scheduler, whoever sent them) and ``vllm:kv_cache_usage_perc`` (a fraction, 0 to 1), each
summed (the usage: the largest) over the label sets an engine exposes. A text without them
gives None: the chooser then counts only its own requests in flight.
"""

from __future__ import annotations

from .balance import EngineLoad

RUNNING, WAITING, KV_USAGE = ("vllm:num_requests_running", "vllm:num_requests_waiting",
                              "vllm:kv_cache_usage_perc")  # fmt: skip


def parse_load(text: str) -> EngineLoad | None:
    values: dict[str, float] = {}
    for line in text.splitlines():
        if not line.startswith("vllm:"):
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name not in (RUNNING, WAITING, KV_USAGE):
            continue
        after = line[line.index("}") + 1:] if "{" in line else line[len(name):]
        try:
            value = float(after.split()[0])   # a sample may carry a timestamp after it
        except (IndexError, ValueError):
            continue
        if name == KV_USAGE:
            values[name] = max(values.get(name, 0.0), value)
        else:
            values[name] = values.get(name, 0.0) + value
    if RUNNING not in values and WAITING not in values:
        return None
    return EngineLoad(int(values.get(RUNNING, 0)), int(values.get(WAITING, 0)),
                      values.get(KV_USAGE, 0.0))
