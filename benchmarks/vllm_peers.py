"""vLLM's own connectors, made to run on a CPU-only machine for the benchmark.

Loaded by the engines through ``kv_connector_module_path`` (the benchmark
puts this directory's parent on their PYTHONPATH); nothing here changes how
the peers move bytes.

- ``TunedNixlConnector``: NIXL as shipped, but its agent's progress thread
  waits 100 µs between polls instead of 0 (NIXL's Python wrapper hard-codes
  0, so each engine burns a core even when idle, which on 2 cores slows the
  other engine's prefill). The benchmark reports stock NIXL too.
- ``CpuMooncakeConnector``: Mooncake's connector asks
  ``torch.accelerator.current_device_index()``, which raises with no
  accelerator; here it is 0, as on a one-GPU node.
"""

from __future__ import annotations

from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.mooncake_connector import (
    MooncakeConnector,
)
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector import NixlConnector

PROGRESS_DELAY_US = 100


class _DelayedAgents:
    """nixl's binding module, but agents are made with a progress delay."""

    def __init__(self, binding: Any) -> None:
        self._binding = binding

    def nixlAgent(self, name: str, config: Any) -> Any:
        config.pthrDelay = PROGRESS_DELAY_US
        return self._binding.nixlAgent(name, config)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._binding, name)


def _delay_nixl_progress() -> None:
    import nixl._api as api  # the runtime module (nixl_cu12's), as nixl injects it

    if not isinstance(api.nixlBind, _DelayedAgents):
        api.nixlBind = _DelayedAgents(api.nixlBind)


class TunedNixlConnector(NixlConnector):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        _delay_nixl_progress()
        super().__init__(*args, **kwargs)


class CpuMooncakeConnector(MooncakeConnector):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        if not torch.accelerator.is_available():
            torch.accelerator.current_device_index = lambda: 0
        super().__init__(*args, **kwargs)
