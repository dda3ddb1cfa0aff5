"""kvbridge operator: kopf handlers over a pure planner that validates prefill against decode
geometry, pairs pods and reports conditions, events and metrics."""

__version__ = "0.1.0"
