from __future__ import annotations

import pytest

from kvwired.errors import ConfigError, UsageError
from kvwired.layout import ChunkCursor, KVLayout, RequestShape, resolve_chunk_bytes

QWEN = KVLayout()


def test_qwen_shape_sizes() -> None:
    assert QWEN.token_layer_bytes == 512
    assert QWEN.token_bytes == 12 * 1024
    assert QWEN.layer_bytes == 2 * 1024 * 1024
    assert QWEN.total_bytes == 48 * 1024 * 1024
    assert QWEN.shape() == RequestShape(24, 2 * 1024 * 1024)


@pytest.mark.parametrize(
    ("name", "size"),
    [("per-token-per-layer", 512), ("per-token", 12288), ("per-layer", 2 << 20),
     ("whole", 48 << 20)],
)
def test_named_granularities(name: str, size: int) -> None:
    assert resolve_chunk_bytes(name) == size
    assert resolve_chunk_bytes(name, QWEN) == size


def test_explicit_and_bad_chunk_sizes() -> None:
    assert resolve_chunk_bytes("64KiB") == 65536
    assert resolve_chunk_bytes(4096) == 4096
    with pytest.raises(ConfigError, match="cannot read"):
        resolve_chunk_bytes("per-banana")
    with pytest.raises(ConfigError, match="at least 1 byte"):
        resolve_chunk_bytes(0)


def test_offsets_are_layer_major_token_major() -> None:
    per_head = QWEN.head_dim * 2
    assert QWEN.offset(0, 0, 0, 0) == 0
    assert QWEN.offset(0, 0, 0, 1) == per_head  # K of head 1 right after K of head 0
    assert QWEN.offset(0, 0, 1, 0) == 2 * per_head  # then V
    assert QWEN.offset(0, 1, 0, 0) == 512  # next token
    assert QWEN.offset(1, 0, 0, 0) == 2 << 20  # next layer
    assert QWEN.offset(23, 4095, 1, 1) + per_head == QWEN.total_bytes


def _walk(shape: RequestShape, chunk: int) -> list[tuple[int, list[tuple[int, int]], int]]:
    cursor = ChunkCursor(shape, chunk)
    out = []
    for layer in range(shape.layers):
        batch = cursor.commit(layer)
        if batch is not None:
            out.append((layer, [(c.offset, c.length) for c in batch.chunks],
                        batch.completes_layer))
    assert cursor.done
    return out


@pytest.mark.parametrize("chunk", [512, 12288, 2 << 20, 48 << 20, 3 << 20, 5000])
def test_chunk_plan_covers_every_byte_once_in_order(chunk: int) -> None:
    shape = QWEN.shape()
    position = 0
    completed = -1
    for layer, chunks, completes in _walk(shape, chunk):
        for offset, length in chunks:
            assert offset == position
            assert 0 < length <= chunk
            position += length
        # The immediate never claims a layer whose bytes are not all sent.
        assert completes <= layer
        assert (completes + 1) * shape.layer_bytes <= position
        assert completes > completed
        completed = completes
    assert position == shape.total_bytes
    assert completed == shape.layers - 1


def test_small_chunks_stay_inside_their_layer() -> None:
    batches = _walk(QWEN.shape(), 12288)
    assert len(batches) == 24
    layer, chunks, completes = batches[0]
    assert (layer, completes) == (0, 0)
    assert len(chunks) == 171  # 170 x 12 KiB + one 8 KiB tail
    assert chunks[-1] == (170 * 12288, 8192)


def test_whole_request_chunk_waits_for_last_layer() -> None:
    batches = _walk(QWEN.shape(), 48 << 20)
    assert batches == [(23, [(0, 48 << 20)], 23)]


def test_chunk_spanning_layers_completes_only_covered_layers() -> None:
    # 3 MiB chunks over 2 MiB layers: the first chunk is sent with layer 1
    # and completes layer 0 only; layer 1 is finished by the next chunk.
    batches = _walk(RequestShape(4, 2 << 20), 3 << 20)
    assert batches[0] == (1, [(0, 3 << 20)], 0)
    assert batches[1] == (2, [(3 << 20, 3 << 20)], 2)
    assert batches[2] == (3, [(6 << 20, 2 << 20)], 3)


def test_commits_must_come_in_order() -> None:
    cursor = ChunkCursor(RequestShape(3, 1024), 512)
    cursor.commit(0)
    with pytest.raises(UsageError, match="layer 1 is next"):
        cursor.commit(2)
    cursor.commit(1)
    cursor.commit(2)
    with pytest.raises(UsageError):
        cursor.commit(3)


def test_bad_layouts_are_refused() -> None:
    with pytest.raises(ConfigError, match="dtype"):
        KVLayout(dtype="fp12")
    with pytest.raises(ConfigError):
        RequestShape(0, 10)
