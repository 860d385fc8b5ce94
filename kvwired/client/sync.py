"""The clients for callers without an event loop: each drives its client on a
``LoopThread``, an event loop on a daemon thread of its own."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Callable, Coroutine, Iterator, Mapping
from typing import Any, Generic, Self, TypeVar

from ..layout import KVLayout, RequestShape
from .push import OutgoingPush
from .receiver import ReceiverClient
from .results import Delivered, LayerLanded, PushResult
from .sender import SenderClient

T = TypeVar("T")
C = TypeVar("C", bound=SenderClient | ReceiverClient)


class LoopThread:
    """An event loop on a daemon thread: the synchronous wrappers' and any
    caller's that drives clients from threads of its own (an engine's hooks)."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True,
                                        name="kvwire-client")
        self._thread.start()

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        return self.submit(coro).result()

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Start ``coro`` on the loop; its future, to wait for or cancel."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def call(self, fn: Any, *args: Any) -> Any:
        async def invoke() -> Any:
            return fn(*args)
        return self.run(invoke())

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=5)


class SyncPush:
    def __init__(self, runner: LoopThread, push: OutgoingPush) -> None:
        self._runner, self._push = runner, push
        self.req, self.shape = push.req, push.shape

    def layer(self, n: int) -> memoryview:
        return self._push.layer(n)

    def commit(self, n: int) -> None:
        self._runner.call(self._push.commit, n)

    def wait_sent(self, n: int) -> None:
        self._runner.run(self._push.wait_sent(n))

    def finish(self) -> PushResult:
        return self._runner.run(self._push.finish())

    def abort(self) -> None:
        self._runner.call(self._push.abort)


class _SyncClient(Generic[C]):
    """A client driven from a thread of its own, for callers without an event loop."""

    def __init__(self, connect: Callable[[], Coroutine[Any, Any, C]]) -> None:
        self._runner = LoopThread()
        try:
            self._client: C = self._runner.run(connect())
        except BaseException:
            self._runner.stop()
            raise

    def close(self) -> None:
        self._runner.run(self._client.close())
        self._runner.stop()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class SyncSenderClient(_SyncClient[SenderClient]):
    def __init__(self, path: str | None = None) -> None:
        super().__init__(lambda: SenderClient.connect(path))

    def open(self, req: str, peer: str | None, shape: RequestShape | KVLayout, *,
             chunk: str | int | None = None, deadline: float | None = None,
             discard: bool = False, note: Mapping[str, Any] | None = None) -> SyncPush:
        push = self._runner.run(self._client.open(req, peer, shape, chunk=chunk,
                                                  deadline=deadline, discard=discard,
                                                  note=note))
        return SyncPush(self._runner, push)

    def push_bytes(self, req: str, peer: str | None, data: bytes, **kwargs: Any) -> PushResult:
        return self._runner.run(self._client.push_bytes(req, peer, data, **kwargs))

    @property
    def peers(self) -> list[str]:
        return self._client.peers


class SyncReceiverClient(_SyncClient[ReceiverClient]):
    def __init__(self, path: str | None = None) -> None:
        super().__init__(lambda: ReceiverClient.connect(path))

    def subscribe(self, req: str) -> None:
        self._runner.call(self._client.subscribe, req)

    def events(self, req: str) -> Iterator[LayerLanded | Delivered]:
        """Layer events of ``req`` in order, then its ``Delivered`` (blocking)."""
        stream = self._client.events(req)

        async def following() -> LayerLanded | Delivered | None:
            return await anext(stream, None)
        while True:
            event = self._runner.run(following())
            if event is None:
                return
            yield event
            if isinstance(event, Delivered):
                return

    def wait_delivered(self, req: str, timeout: float | None = None) -> Delivered:
        return self._runner.run(self._client.wait_delivered(req, timeout))

    def view(self, event: Delivered | LayerLanded) -> memoryview:
        return self._client.view(event)

    def release(self, req: str) -> None:
        self._runner.run(self._client.release(req))

    def unsubscribe(self, req: str) -> None:
        """Let go of ``req`` without releasing it: kept for another engine."""
        self._runner.run(self._client.unsubscribe(req))
