"""``KvwireConnector``: vLLM's KV connector API (v1, vLLM 0.32) over kvwire.

Load it the way vLLM loads out-of-tree connectors:

    --kv-transfer-config '{"kv_connector": "KvwireConnector",
      "kv_connector_module_path": "kvwire_vllm.connector",
      "kv_role": "kv_producer",            # the prefill engine; kv_consumer: decode
      "kv_load_failure_policy": "recompute",
      "kv_connector_extra_config": {"receiver": "decode-0", "deadline": 20}}'

The connector is a client of the node's kvwire daemon (the sender on a
prefill node, the receiver on a decode node) over its unix socket; the
transport, TLS, discovery and rails are the daemons' business.

vLLM builds one instance per role: in the scheduler (``ProducerPlanner`` or
``ConsumerPlanner``, which plan) and in each worker (``Producer`` or
``Consumer``, which move bytes). The plan crosses between them as
``KvwireMetadata``, each step.

Each instance describes its engine the same way (kvwire_vllm.describe):
tensor-parallel ranks push and load KV heads (kvwire_vllm.shards), MLA
caches move once, and a hybrid engine's KV-cache groups move group by group
(``SupportsHMA``: vLLM keeps its hybrid manager on, and a sliding-window
group moves only the blocks inside the window).
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

from kvwired import tracing

from . import stats as stats_module
from .cache import KVCacheBlocks, block_format
from .describe import describe
from .params import ConnectorSettings
from .scheduling import ConsumerPlanner, ProducerPlanner, StepPlan

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks as VllmBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

    from .consumer import Consumer
    from .producer import Producer

log = logging.getLogger("vllm.kvwire.connector")
# A folder each worker writes its counters into when its connector shuts down.
COUNTERS_FOLDER = "KVWIRE_CONNECTOR_COUNTERS"


@dataclass
class KvwireMetadata(KVConnectorMetadata):
    plan: StepPlan = field(default_factory=StepPlan)
    idle: bool = False  # the step computes no token (vLLM steps it only to poll loads)


@dataclass
class KvwireStats(KVConnectorStats):
    """The worker's counters (kvwire_vllm.stats), as vLLM collects them."""

    def __post_init__(self) -> None:
        self.data: dict[str, Any]
        if not self.data:
            self.data = stats_module.ConnectorCounters.empty()

    def reset(self) -> None:
        self.data = stats_module.ConnectorCounters.empty()

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        self.data = stats_module.merge(self.data, other.data)
        return self

    def reduce(self) -> dict[str, int | float]:
        return stats_module.summary(self.data)

    def is_empty(self) -> bool:
        return not any(self.data.get(key) for key in stats_module.COUNTERS)


class KvwireConnector(KVConnectorBase_V1, SupportsHMA):
    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole,
                 kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        transfer = self._kv_transfer_config
        if transfer.kv_role not in ("kv_producer", "kv_consumer"):
            raise ValueError(f"kvwire's connector is a kv_producer (prefill) or a "
                             f"kv_consumer (decode), not {transfer.kv_role!r}")
        self.producing = transfer.kv_role == "kv_producer"
        self.settings = ConnectorSettings.from_extra(transfer.kv_connector_extra_config)
        # Off unless $KVWIRE_TRACES asks (kvwired.tracing): then the scheduler
        # and each worker record their part of a traced request.
        tracing.configure("vllm-prefill" if self.producing else "vllm-decode")
        # Refuses, now, a shape kvwire cannot carry (pipeline stages, Mamba ...).
        device = getattr(vllm_config.device_config, "device_type", None) or "cpu"
        self.engine = describe(vllm_config, kv_cache_config, block_format(str(device)))
        self.block_size = self.engine.layout.block_size
        self.counters = stats_module.ConnectorCounters()
        self._reported = stats_module.ConnectorCounters.empty()  # what vLLM took
        self._producer_planner: ProducerPlanner | None = None
        self._consumer_planner: ConsumerPlanner | None = None
        self.rank = 0  # the worker's tensor-parallel rank, once its cache is registered
        self._producer: Producer | None = None
        self._consumer: Consumer | None = None
        if role == KVConnectorRole.SCHEDULER:
            windows = [group.window for group in self.engine.groups]
            log.info("kvwire: %s; layout %s", "prefill" if self.producing else "decode",
                     self.engine.layout.to_params())
            if self.producing:
                self._producer_planner = ProducerPlanner(self.settings, self.block_size,
                                                         windows, self.engine.layout)
            else:
                self._consumer_planner = ConsumerPlanner(self.block_size, windows,
                                                         self.engine.layout)

    # ------------------------------------------------------------ scheduler

    def on_new_request(self, request: Request) -> None:
        if self._producer_planner is not None:
            self._producer_planner.on_new_request(request)

    def get_num_new_matched_tokens(self, request: Request,
                                   num_computed_tokens: int) -> tuple[int | None, bool]:
        if self._consumer_planner is None:
            return 0, False
        return self._consumer_planner.matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, blocks: VllmBlocks,
                                 num_external_tokens: int) -> None:
        if self._consumer_planner is not None and num_external_tokens > 0:
            self._consumer_planner.allocated(request, blocks.get_block_ids(),
                                             num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        if self._consumer_planner is not None:
            return KvwireMetadata(self._consumer_planner.plan(
                r.req_id for r in scheduler_output.scheduled_new_reqs),
                idle=scheduler_output.total_num_scheduled_tokens == 0)
        assert self._producer_planner is not None
        cached = scheduler_output.scheduled_cached_reqs
        new = [(r.req_id, r.block_ids, r.num_computed_tokens)
               for r in scheduler_output.scheduled_new_reqs]
        resumed = cached.resumed_req_ids
        added = [(req_id, blocks, req_id in resumed, computed)
                 for req_id, blocks, computed in zip(cached.req_ids, cached.new_block_ids,
                                                     cached.num_computed_tokens, strict=True)]
        return KvwireMetadata(self._producer_planner.plan(
            new, added, scheduler_output.num_scheduled_tokens))

    def request_finished_all_groups(self, request: Request, block_ids: tuple[list[int], ...]
                                    ) -> tuple[bool, dict[str, Any] | None]:
        return self.request_finished(request, block_ids[0])

    def request_finished(self, request: Request,
                         block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        # vLLM itself holds a loading request's blocks until its load is
        # reported finished.
        if self._producer_planner is not None:
            params = self._producer_planner.finished(request.request_id)
            # A pushed request's blocks stay until the worker has them in
            # staging (get_finished): at once, unless its push opened late.
            return bool(params and params["kvwire_tokens"]), params
        if self._consumer_planner is not None:
            self._consumer_planner.finished(request.request_id)
        return False, None

    # --------------------------------------------------------------- worker

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        cache = KVCacheBlocks(kv_caches, self.engine)
        self.rank = get_tensor_model_parallel_rank()
        placement = self.engine.placement
        log.info("kvwire: rank %d of %d %s KV heads %s of %d (%s), %d blocks",
                 self.rank, placement.tp,
                 "pushing as the prefill engine" if self.producing
                 else "loading as the decode engine",
                 list(placement.pushes(self.rank) if self.producing
                      else placement.held(self.rank)),
                 placement.heads, self.engine.layout.groups, cache.num_blocks)
        if self.producing:
            from .producer import Producer
            self._producer = Producer(self.settings, cache, self.rank, self.counters)
        else:
            from .consumer import Consumer
            self._consumer = Consumer(self.settings, cache, self.rank, self.counters)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        # Before the forward pass: the step's pushes are opened now, so their
        # leases are granted while the first layers compute.
        super().bind_connector_metadata(connector_metadata)
        if self._producer is not None and isinstance(connector_metadata, KvwireMetadata):
            self._producer.begin_step(connector_metadata.plan.pushes)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        metadata = self._get_connector_metadata()
        if self._consumer is not None and isinstance(metadata, KvwireMetadata):
            self._consumer.begin_step(metadata.plan.loads, metadata.plan.restores)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads are asynchronous: a request runs only once its load ended

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor,
                      attn_metadata: AttentionMetadata, **kwargs: Any) -> None:
        if self._producer is not None:
            self._producer.save_layer(layer_name)

    def wait_for_save(self) -> None:
        if self._producer is not None:
            self._producer.end_step()
        elif self._consumer is not None:
            self._consumer.end_step()

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        if self._producer is not None:
            return KVConnectorTransferResults(
                finished_sending=self._producer.finished_sending(finished_req_ids))
        if self._consumer is None:
            return KVConnectorTransferResults()
        self._consumer.cancel(finished_req_ids)
        metadata = self._get_connector_metadata()
        if isinstance(metadata, KvwireMetadata) and metadata.idle and not finished_req_ids:
            self._consumer.wait_for_a_load(self.settings.idle_wait)
        finished, failed = self._consumer.take_results()
        return KVConnectorTransferResults(finished_recving=finished, failed_recving=failed)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None,
                                                                 set[str] | None]:
        results = self.get_transfer_results(finished_req_ids)
        return results.finished_sending, results.finished_recving

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._consumer.take_failed_blocks() if self._consumer is not None else set()

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        data = self.counters.take()
        self._reported = stats_module.merge(self._reported, data)
        stats = KvwireStats(data=data)
        return None if stats.is_empty() else stats

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None
                                 ) -> KVConnectorStats | None:
        return KvwireStats(data=data or {})

    def counters_so_far(self) -> dict[str, Any]:
        """Everything counted, including what vLLM's stats already took."""
        return stats_module.merge(self._reported, self.counters.snapshot())

    def shutdown(self) -> None:
        for side in (self._producer, self._consumer):
            if side is not None:
                side.close()
        # Each worker's counters, for a caller that runs the engine and cannot
        # reach its workers' processes (kvwire_vllm.offline, at TP above 1).
        folder = os.environ.get(COUNTERS_FOLDER)
        if folder and (self._producer is not None or self._consumer is not None):
            role = "prefill" if self.producing else "decode"
            path = Path(folder) / f"{role}-rank{self.rank}.json"
            path.write_text(json.dumps(self.counters_so_far()))
