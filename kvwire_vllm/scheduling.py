"""The connector's scheduler side: which request pushes or loads which blocks.

It runs in vLLM's scheduler and only plans. Each engine step it hands the
worker side a ``StepPlan``: the pushes whose prompt is fully computed in this
step (every layer of their blocks is written during this step's forward
pass), and the loads whose blocks were just allocated.

No vLLM import: requests are read through the few attributes used here, so
the planning is tested with the daemons' suite (tests/unit/test_vllm_planning.py).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from kvwired.errors import KvwireError

from .params import ConnectorSettings, LoadOrder, PushOrder

# vLLM drops log lines of loggers outside its own namespace.
log = logging.getLogger("vllm.kvwire.scheduling")


class RequestLike(Protocol):
    """What the planners read of vLLM's ``Request``."""

    @property
    def request_id(self) -> str: ...
    @property
    def prompt_token_ids(self) -> Sequence[int] | None: ...
    @property
    def kv_transfer_params(self) -> dict[str, Any] | None: ...


@dataclass(frozen=True)
class PushPlan:
    """Push these blocks (all the request's prompt blocks), every layer."""

    req_id: str
    order: PushOrder
    block_ids: list[int]
    deadline: float  # seconds left of the order's deadline when planned


@dataclass(frozen=True)
class LoadPlan:
    """Load pushed blocks ``first .. first + len(block_ids)`` of ``total`` into
    ``block_ids``."""

    req_id: str
    order: LoadOrder
    tokens: int  # the prompt tokens pushed
    first: int
    total: int
    block_ids: list[int]


@dataclass
class StepPlan:
    pushes: list[PushPlan] = field(default_factory=list)
    loads: list[LoadPlan] = field(default_factory=list)


def blocks_of(tokens: int, block_size: int) -> int:
    """Blocks holding ``tokens``, the last one perhaps partly: a push moves them
    all, so the decode engine computes only the prompt's last token again
    (vLLM's rule for a prompt wholly in cache), not up to a block of them."""
    return -(-tokens // block_size)


@dataclass
class _Pushing:
    order: PushOrder
    prompt_len: int
    started: float  # monotonic: when the prefill engine took the request
    block_ids: list[int] = field(default_factory=list)
    tokens: int | None = None  # pushed tokens, once planned


class ProducerPlanner:
    """Prefill side: a push for every request that asks for remote decode."""

    def __init__(self, settings: ConnectorSettings, block_size: int) -> None:
        self.settings = settings
        self.block_size = block_size
        self._requests: dict[str, _Pushing] = {}

    def on_new_request(self, request: RequestLike) -> None:
        try:
            order = PushOrder.from_params(request.kv_transfer_params, self.settings.deadline)
        except KvwireError as exc:
            log.error("kvwire: request %s will not be pushed: %s", request.request_id, exc)
            return
        if order is None:
            return
        if order.receiver is None and self.settings.receiver is not None:
            order = PushOrder(order.transfer, self.settings.receiver, order.deadline)
        self._requests[request.request_id] = _Pushing(
            order, len(request.prompt_token_ids or ()), time.monotonic())

    def plan(self, new: Iterable[tuple[str, list[int], int]],
             cached: Iterable[tuple[str, list[int] | None, bool, int]],
             scheduled: dict[str, int]) -> StepPlan:
        """``new``: (request, its blocks, tokens computed before this step);
        ``cached``: (request, blocks added, resumed, tokens computed before).
        A resumed request's blocks replace its list (vLLM's rule)."""
        plan = StepPlan()
        steps: list[tuple[str, list[int] | None, bool, int]] = [
            (req, blocks, True, computed) for req, blocks, computed in new]
        steps += cached
        for req_id, blocks, replace, computed in steps:
            pushing = self._requests.get(req_id)
            if pushing is None or pushing.tokens is not None:
                continue
            if replace:
                pushing.block_ids = list(blocks or ())
            elif blocks:
                pushing.block_ids.extend(blocks)
            if computed + scheduled.get(req_id, 0) < pushing.prompt_len:
                continue  # a chunk of a longer prefill: its last one pushes
            count = blocks_of(pushing.prompt_len, self.block_size)
            pushing.tokens = pushing.prompt_len
            if count:
                left = pushing.order.deadline - (time.monotonic() - pushing.started)
                plan.pushes.append(PushPlan(req_id, pushing.order, pushing.block_ids[:count],
                                            max(left, 0.001)))
        return plan

    def finished(self, req_id: str) -> dict[str, Any] | None:
        """The params the decode engine gets; None if no push was asked for.

        A request that ended before its prompt was computed pushed nothing:
        its params say 0 tokens, and the decode engine computes the prompt."""
        pushing = self._requests.pop(req_id, None)
        if pushing is None:
            return None
        left = pushing.order.deadline - (time.monotonic() - pushing.started)
        return pushing.order.answer(pushing.tokens or 0, left)


class ConsumerPlanner:
    """Decode side: an asynchronous load for every request with remote prefill."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._loading: set[str] = set()
        self._pending: list[LoadPlan] = []

    def matched_tokens(self, request: RequestLike, computed: int) -> tuple[int, bool]:
        """vLLM's ``get_num_new_matched_tokens``: the tokens a push brings beyond
        what this engine has, loaded asynchronously. Asked again after the load
        (and may be asked several times before it): no side effects."""
        if request.request_id in self._loading:
            return 0, False
        order = self._order(request)
        if order is None:
            return 0, False
        count = self._tokens(request, order) - computed
        return (count, True) if count > 0 else (0, False)

    def allocated(self, request: RequestLike, block_ids: Sequence[int],
                  external_tokens: int) -> None:
        """vLLM's ``update_state_after_alloc``: the request's blocks, the last
        ``external_tokens`` of whose prefix the push fills."""
        if external_tokens <= 0 or request.request_id in self._loading:
            return
        order = self._order(request)
        if order is None:
            return
        tokens = self._tokens(request, order)
        total = blocks_of(tokens, self.block_size)
        # What this engine had already is whole blocks (its prefix cache).
        first = (tokens - external_tokens) // self.block_size
        self._loading.add(request.request_id)
        self._pending.append(LoadPlan(request.request_id, order, tokens, first, total,
                                      list(block_ids[first:total])))

    def plan(self) -> StepPlan:
        plan = StepPlan(loads=self._pending)
        self._pending = []
        return plan

    def finished(self, req_id: str) -> None:
        self._loading.discard(req_id)

    @staticmethod
    def _tokens(request: RequestLike, order: LoadOrder) -> int:
        """The tokens pushed: the prefill engine's count, or (asked before it
        answered) the whole prompt, which is what a push carries."""
        return order.tokens if order.tokens is not None else len(request.prompt_token_ids or ())

    @staticmethod
    def _order(request: RequestLike) -> LoadOrder | None:
        try:
            return LoadOrder.from_params(request.kv_transfer_params)
        except KvwireError as exc:
            log.error("kvwire: request %s computes its prompt itself: %s",
                      request.request_id, exc)
            return None
