"""Messages over an asyncio stream: where the I/O-free framing meets a socket.

The control connection, the daemons' unix APIs and the client library all
read through ``MessageStream``; the frame format itself lives in
``protocol`` and knows nothing of sockets.
"""

from __future__ import annotations

import asyncio
import contextlib

from .protocol import Channel, FrameDecoder, Message, RawMessage, encode

READ_BYTES = 64 * 1024


class MessageStream:
    """One side of a framed connection: ``receive`` what comes, ``send`` frames."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                 channel: Channel, decoder: FrameDecoder | None = None) -> None:
        self.reader = reader
        self.writer = writer
        # A decoder may arrive holding bytes already read (the client's
        # blocking handshake hands its decoder over).
        self.decoder = decoder or FrameDecoder(channel)

    async def receive(self) -> Message | None:
        """The next validated, typed message, or None at a clean end of stream."""
        while (msg := self.decoder.next_message()) is None:
            data = await self.reader.read(READ_BYTES)
            if not data:
                self.decoder.end_of_stream()
                return None
            self.decoder.feed(data)
        return msg

    def buffered(self) -> Message | None:
        """The next message if its bytes are already read, without waiting."""
        return self.decoder.next_message()

    def send(self, msg: Message | RawMessage) -> None:
        if not self.writer.is_closing():
            self.writer.write(encode(msg))

    @property
    def closing(self) -> bool:
        return self.writer.is_closing()

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.writer.close()
