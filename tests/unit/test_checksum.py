"""A request's checksum: per-layer digests, combined; what the receiver reports."""

from __future__ import annotations

import os

from hypothesis import given
from hypothesis import strategies as st

from kvwired import checksum
from kvwired.layout import RequestShape


@given(layers=st.integers(1, 8), layer_bytes=st.integers(1, 512), data=st.data())
def test_the_layers_hashed_one_by_one_give_the_buffers_checksum(
        layers: int, layer_bytes: int, data: st.DataObject) -> None:
    shape = RequestShape(layers, layer_bytes)
    buffer = data.draw(st.binary(min_size=shape.total_bytes, max_size=shape.total_bytes))
    by_layer = [checksum.of_layer(buffer[n * layer_bytes : (n + 1) * layer_bytes])
                for n in range(layers)]
    assert checksum.combine(by_layer) == checksum.of_buffer(buffer, shape)


@given(layers=st.integers(1, 6), layer_bytes=st.integers(1, 256), data=st.data())
def test_any_one_changed_byte_changes_it(layers: int, layer_bytes: int,
                                         data: st.DataObject) -> None:
    shape = RequestShape(layers, layer_bytes)
    buffer = bytearray(data.draw(st.binary(min_size=shape.total_bytes,
                                           max_size=shape.total_bytes)))
    before = checksum.of_buffer(bytes(buffer), shape)
    where = data.draw(st.integers(0, shape.total_bytes - 1))
    buffer[where] ^= data.draw(st.integers(1, 255))
    assert checksum.of_buffer(bytes(buffer), shape) != before


def test_layer_order_and_layer_count_are_part_of_it() -> None:
    a, b = os.urandom(64), os.urandom(64)
    assert checksum.of_buffer(a + b, RequestShape(2, 64)) != checksum.of_buffer(
        b + a, RequestShape(2, 64))
    # The same bytes cut into a different number of layers is another request.
    assert checksum.of_buffer(a + b, RequestShape(2, 64)) != checksum.of_buffer(
        a + b, RequestShape(1, 128))
    assert checksum.of_buffer(a + b) == checksum.of_buffer(a + b, RequestShape(1, 128))


def test_it_fits_the_protocols_unsigned_64_bit_field() -> None:
    value = checksum.of_buffer(os.urandom(4096), RequestShape(4, 1024))
    assert 0 <= value < 1 << 64
