"""kvbridge's P/D router: an OpenAI-compatible HTTP front for one KVTransfer's vLLM engines
that sends every request over a prefill/decode pair the operator paired and the decode
verified with a preflight handshake, in vLLM's P/D request flow.

- :mod:`.table`   pure: the verified pairs, from the KVTransfer and its KVEndpoints
- :mod:`.balance` pure: which verified pair, least-load or cache-aware (cost per pair)
- :mod:`.prefix`  pure: which prompt blocks each engine holds (:mod:`.kv_events` feeds it)
- :mod:`.prompts` pure: a request's prompt as text, token ids or a /tokenize request
- :mod:`.engine_load` pure: an engine's queue from its /metrics
- :mod:`.affinity` the cache-aware inputs kept current: KV-event subscribers, load polls
- :mod:`.picker`, :mod:`.extproc` the inference gateway's endpoint picker
- :mod:`.sidecar` the decode pod's P/D sidecar
- :mod:`.flow`    pure: the prefill and decode requests, the lease rule
- :mod:`.proxy`   aiohttp handlers: retries, streaming, errors (:mod:`.fanout` for batched
  prompts and ``n``; :mod:`.upstream` the answers a request ends in; :mod:`.settings`)
- :mod:`.errors`  the router's error tree, under ``RouterError``
- :mod:`.watch`   the KVTransfer and KVEndpoint watches that keep the table current
- :mod:`.metrics` Prometheus metrics

Run it as ``kvbridge-router --transfer NAME`` (``python -m kvbridge_router``).
"""
