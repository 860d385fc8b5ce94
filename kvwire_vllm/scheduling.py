"""The connector's scheduler side: which request pushes or loads which blocks.

It runs in vLLM's scheduler and only plans. Each engine step it hands the
worker side a ``StepPlan``: the pushes whose prompt is fully computed in this
step (every layer of their blocks is written during this step's forward
pass), and the loads whose blocks were just allocated.

No vLLM import: requests are read through the few attributes used here, so
the planning is tested with the daemons' suite (tests/unit/test_vllm_planning.py).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from kvwired import tracing
from kvwired.errors import KvwireError

from .params import ConnectorSettings, LoadOrder, PushOrder
from .shards import EngineLayout

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


Blocks = tuple[list[int], ...]  # a request's block ids, one list per KV-cache group
NULL_BLOCK = 0  # vLLM's placeholder for a sliding-window block out of the window


def pushed_from(tokens: int, block_size: int, window: int | None) -> int:
    """The first block of a group that a push of ``tokens`` carries.

    Every block for full attention. For a sliding window of ``window`` tokens
    (vLLM's hybrid manager on), the blocks holding the last ``window`` tokens
    and the one before them: the decode engine computes the prompt's last
    token again, whose window reaches back to token ``tokens - window``.
    vLLM replaced the blocks before it with its null block on both sides."""
    if window is None:
        return 0
    return max(0, tokens - window) // block_size


@dataclass(frozen=True)
class PushPlan:
    """Push these blocks of each KV-cache group, every layer."""

    req_id: str
    order: PushOrder
    tokens: int  # the prompt tokens pushed
    blocks: Blocks  # per group: blocks pushed_from .. blocks_of(tokens)
    deadline: float  # seconds left of the order's deadline when planned


@dataclass(frozen=True)
class GroupLoad:
    """One KV-cache group of a load: the push carries prompt blocks
    ``pushed_from ..``; this engine fills blocks ``load_from ..`` into
    ``block_ids`` (its null block, out of a sliding window, is skipped)."""

    pushed_from: int
    load_from: int
    block_ids: list[int]
    # The blocks holding the tail the engine computes again (recompute > 1),
    # whose loaded bytes are written back once it has (``StepPlan.restores``).
    kept: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class LoadPlan:
    """Load the pushed blocks this engine lacks, group by group; ``refusal``:
    why this engine cannot take the push (the load fails at once, and vLLM's
    kv_load_failure_policy decides)."""

    req_id: str
    order: LoadOrder
    tokens: int  # the prompt tokens pushed
    first: int  # blocks this engine had already (its prefix cache)
    total: int  # blocks of the prompt
    groups: tuple[GroupLoad, ...]
    refusal: str | None = None
    # Tokens the load gives the engine beyond its prefix cache (vLLM's
    # external tokens): the pushed ones it will not compute itself.
    loaded: int = 0

    @property
    def block_ids(self) -> list[int]:
        """Every block the load writes, null blocks left out."""
        return [b for g in self.groups for b in g.block_ids if b != NULL_BLOCK]


@dataclass
class StepPlan:
    pushes: list[PushPlan] = field(default_factory=list)
    loads: list[LoadPlan] = field(default_factory=list)
    # Loaded requests whose recomputed tail this step computes: their kept
    # blocks get the pushed bytes back after the step's forward pass.
    restores: list[str] = field(default_factory=list)


def tail_to_recompute(layout: EngineLayout | None) -> int:
    """The prompt's last tokens the decode engine computes itself over a
    loaded cache: one (vLLM's rule for a prompt wholly in cache), or two for
    MLA on the CPU backend. vLLM's CPU MLA computes a lone token over a cached
    context with its decode kernel, which disagrees with its prefill path: a
    plain engine fed its own first token continues otherwise at 5 of 8 prompt
    lengths on the test model. Two tokens take the prefill path over the
    cached context, as the plain engine's prefill does."""
    if layout is not None and layout.attention == "mla" and layout.block_format.startswith("cpu/"):
        return 2
    return 1


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
    block_ids: list[list[int]] = field(default_factory=list)  # per group
    tokens: int | None = None  # pushed tokens, once planned
    # The engine's part of the request's trace: taken, first scheduled, answered.
    span: tracing.Span = tracing.NO_SPAN


class ProducerPlanner:
    """Prefill side: a push for every request that asks for remote decode.

    ``windows``: per KV-cache group, its sliding window in tokens (None: full
    attention or MLA). ``layout``: the engine's, as its answer announces it."""

    def __init__(self, settings: ConnectorSettings, block_size: int,
                 windows: Sequence[int | None] = (None,),
                 layout: EngineLayout | None = None) -> None:
        self.settings = settings
        self.block_size = block_size
        self.windows = tuple(windows)
        self.layout = layout
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
            order = dataclasses.replace(order, receiver=self.settings.receiver)
        prompt_len = len(request.prompt_token_ids or ())
        self._requests[request.request_id] = _Pushing(
            order, prompt_len, time.monotonic(),
            span=tracing.start("kvwire.prefill", order.trace, {
                "kvwire.transfer": order.transfer, "kvwire.tokens": prompt_len}))

    def plan(self, new: Iterable[tuple[str, Sequence[list[int]], int]],
             cached: Iterable[tuple[str, Sequence[list[int]] | None, bool, int]],
             scheduled: dict[str, int]) -> StepPlan:
        """``new``: (request, its blocks per group, tokens computed before this
        step); ``cached``: (request, blocks added per group, resumed, tokens
        computed before). A resumed request's blocks replace its lists (vLLM's
        rule)."""
        plan = StepPlan()
        steps: list[tuple[str, Sequence[list[int]] | None, bool, int]] = [
            (req, blocks, True, computed) for req, blocks, computed in new]
        steps += cached
        for req_id, blocks, replace, computed in steps:
            pushing = self._requests.get(req_id)
            if pushing is None or pushing.tokens is not None:
                continue
            if not pushing.block_ids:
                pushing.span.add_event("scheduled")
            if replace or not pushing.block_ids:
                pushing.block_ids = [list(g) for g in blocks or [[]] * len(self.windows)]
            elif blocks:
                for mine, added in zip(pushing.block_ids, blocks, strict=True):
                    mine.extend(added)
            if computed + scheduled.get(req_id, 0) < pushing.prompt_len:
                continue  # a chunk of a longer prefill: its last one pushes
            tokens = pushing.prompt_len
            count = blocks_of(tokens, self.block_size)
            pushing.tokens = tokens
            if count:
                left = pushing.order.deadline - (time.monotonic() - pushing.started)
                groups = tuple(ids[pushed_from(tokens, self.block_size, window):count]
                               for ids, window in zip(pushing.block_ids, self.windows,
                                                      strict=True))
                plan.pushes.append(PushPlan(req_id, pushing.order, tokens, groups,
                                            max(left, 0.001)))
        return plan

    def finished(self, req_id: str) -> dict[str, Any] | None:
        """The params the decode engine gets; None if no push was asked for.

        A request that ended before its prompt was computed pushed nothing:
        its params say 0 tokens, and the decode engine computes the prompt."""
        pushing = self._requests.pop(req_id, None)
        if pushing is None:
            return None
        pushing.span.end()  # the prefill engine answers now
        left = pushing.order.deadline - (time.monotonic() - pushing.started)
        return pushing.order.answer(pushing.tokens or 0, left, self.layout)


class ConsumerPlanner:
    """Decode side: an asynchronous load for every request with remote prefill."""

    def __init__(self, block_size: int, windows: Sequence[int | None] = (None,),
                 layout: EngineLayout | None = None) -> None:
        self.block_size = block_size
        self.windows = tuple(windows)
        self.layout = layout
        self.recompute = tail_to_recompute(layout)  # the prompt's last tokens it computes
        self._loading: set[str] = set()
        self._tails: set[str] = set()  # loaded with kept blocks, not yet computed
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
        count = self._loaded(self._tokens(request, order)) - computed
        return (count, True) if count > 0 else (0, False)

    def allocated(self, request: RequestLike, block_ids: Sequence[Sequence[int]],
                  external_tokens: int) -> None:
        """vLLM's ``update_state_after_alloc``: the request's blocks per group,
        the last ``external_tokens`` of whose prefix the push fills."""
        if external_tokens <= 0 or request.request_id in self._loading:
            return
        order = self._order(request)
        if order is None:
            return
        tokens = self._tokens(request, order)
        total = blocks_of(tokens, self.block_size)
        # What this engine had already is whole blocks (its prefix cache).
        first = (self._loaded(tokens) - external_tokens) // self.block_size
        groups = []
        refusal = self._refusal(order)
        for n, (ids, window) in enumerate(zip(block_ids, self.windows, strict=True)):
            start = pushed_from(tokens, self.block_size, window)
            wanted = [b for b in ids[first:start] if b != NULL_BLOCK]
            if wanted and refusal is None:
                refusal = (f"KV-cache group {n} needs blocks {first}..{start - 1}, which the "
                           "push leaves out as outside its sliding window")
            load_from = max(first, start)
            groups.append(GroupLoad(start, load_from, list(ids[load_from:total]),
                                    self._kept(tokens, ids, load_from)))
        self._loading.add(request.request_id)
        if refusal is None and any(group.kept for group in groups):
            self._tails.add(request.request_id)
        self._pending.append(LoadPlan(request.request_id, order, tokens, first, total,
                                      tuple(groups), refusal, external_tokens))

    def _kept(self, tokens: int, ids: Sequence[int], load_from: int) -> list[int]:
        """The loaded blocks holding the tail this engine computes again beyond
        vLLM's one token. Its own computation of them (over a cached context)
        may differ from the prefill engine's by rounding, and later tokens
        attend to them: the pushed bytes are written back once computed."""
        if self.recompute <= 1 or tokens <= self.recompute:
            return []
        first = max(load_from, (tokens - self.recompute) // self.block_size)
        return [b for b in ids[first:blocks_of(tokens, self.block_size)] if b != NULL_BLOCK]

    def _loaded(self, tokens: int) -> int:
        """The prompt tokens a push of ``tokens`` gives this engine: all of them
        where vLLM computes the last one again itself (a prompt wholly in
        cache), else all but the ``recompute`` last."""
        return tokens if self.recompute <= 1 else max(0, tokens - self.recompute)

    def _refusal(self, order: LoadOrder) -> str | None:
        """Why this engine cannot take the push the prefill engine announced."""
        if order.layout is None or self.layout is None:
            return None
        differences = self.layout.differences(order.layout)
        if not differences:
            return None
        return ("the prefill engine's KV layout differs from this engine's: "
                + "; ".join(differences))

    def plan(self, scheduled: Iterable[str] = ()) -> StepPlan:
        """``scheduled``: the requests this step computes for the first time
        (a loaded request's first step computes its tail)."""
        restores = [req_id for req_id in scheduled if req_id in self._tails]
        self._tails.difference_update(restores)
        plan = StepPlan(loads=self._pending, restores=restores)
        self._pending = []
        return plan

    def finished(self, req_id: str) -> None:
        self._loading.discard(req_id)
        self._tails.discard(req_id)

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
