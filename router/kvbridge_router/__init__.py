"""kvbridge's P/D router: an OpenAI-compatible HTTP front for one KVTransfer's vLLM engines
that sends every request over a prefill/decode pair the operator paired and the decode
verified with a preflight handshake, in vLLM's P/D request flow.

- :mod:`.table`   pure: the verified pairs, from the KVTransfer and its KVEndpoints
- :mod:`.balance` pure: the least-loaded decode, then its least-loaded verified prefill
- :mod:`.flow`    pure: the prefill and decode requests, the lease rule
- :mod:`.proxy`   aiohttp handlers: retries, streaming, errors
- :mod:`.watch`   the KVTransfer and KVEndpoint watches that keep the table current
- :mod:`.metrics` Prometheus metrics

Run it as ``kvbridge-router --transfer NAME`` (``python -m kvbridge_router``).
"""
