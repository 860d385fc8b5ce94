"""A man in the middle of kvwire's TCP data path that flips one byte.

It runs in the decode host's namespace. nftables redirects the data
connections arriving from the prefill host (to ``--data-port``) to it; it
forwards them to the receiver on the same address and, in the sender's
direction, parses kvwire's frames (a 16-byte session token, then a 32-byte
header and a body per write) to flip one bit of the body of the first write
of ``--min-bytes`` or more, once. Everything else passes unchanged. A real
TCP connection, a real byte changed in flight: what only an end-to-end
check can catch (control traffic is TLS; the data path trusts its keys).

    python -m tests.flip_relay --listen 17472 --to 198.18.77.2:7472
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib

from kvwired.transport.tcp.frames import HEADER, TO_RESPONDER, TOKEN_BYTES, decode_header


class Flipper:
    def __init__(self, min_bytes: int) -> None:
        self.min_bytes = min_bytes
        self.flipped = False

    async def sender_to_receiver(self, reader: asyncio.StreamReader,
                                 writer: asyncio.StreamWriter) -> None:
        writer.write(await reader.readexactly(TOKEN_BYTES))
        while True:
            header = await reader.readexactly(HEADER.size)
            length = decode_header(header, 0, TO_RESPONDER)[4]
            writer.write(header)
            body = bytearray(await reader.readexactly(length))
            if body and not self.flipped and length >= self.min_bytes:
                body[length // 2] ^= 0x10
                self.flipped = True
                print(f"flipped a bit of byte {length // 2} of a {length} B write",
                      flush=True)
            writer.write(body)
            await writer.drain()


async def pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    while chunk := await reader.read(1 << 16):
        writer.write(chunk)
        await writer.drain()


async def serve(listen: int, to: str, min_bytes: int) -> None:
    host, _, port = to.rpartition(":")
    flipper = Flipper(min_bytes)

    async def relay(down_reader: asyncio.StreamReader,
                    down_writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection(host, int(port))
        tasks = [asyncio.create_task(flipper.sender_to_receiver(down_reader, up_writer)),
                 asyncio.create_task(pipe(up_reader, down_writer))]
        with contextlib.suppress(Exception):
            await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        for task in tasks:
            task.cancel()
        for writer in (up_writer, down_writer):
            writer.close()

    server = await asyncio.start_server(relay, "0.0.0.0", listen)
    print(f"relaying :{listen} -> {to}", flush=True)
    async with server:
        await server.serve_forever()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--listen", type=int, required=True)
    parser.add_argument("--to", required=True)
    parser.add_argument("--min-bytes", type=int, default=4096)
    args = parser.parse_args()
    asyncio.run(serve(args.listen, args.to, args.min_bytes))


if __name__ == "__main__":
    main()
