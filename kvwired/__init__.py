"""kvwire: move LLM KV cache between prefill and decode nodes over RDMA."""

__version__ = "0.1.0"
