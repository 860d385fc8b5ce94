"""Regrouping a head's tokens between block sizes, for any format a kernel keeps.

The vLLM suites check the kernel's real map (``kernel_token_map``) through an
engine; here the gather is checked against the tokens it must move, for the
CPU kernel's format as measured (K transposed, then V) and for shuffled ones.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvwire_vllm.blockmap import TokenMap, plan_gather, regroup, regroup_index

HEAD = 4


def transposed_k(block_size: int, head_size: int = HEAD) -> TokenMap:
    """The CPU kernel's format on AVX-512: K as [head_size, block_size], then V."""
    offsets = np.empty((2, block_size, head_size), dtype=np.int64)
    tokens, dims = np.meshgrid(np.arange(block_size), np.arange(head_size), indexing="ij")
    offsets[0] = dims * block_size + tokens
    offsets[1] = block_size * head_size + tokens * head_size + dims
    return TokenMap(offsets)


def shuffled(block_size: int, seed: int) -> TokenMap:
    order = np.random.default_rng(seed).permutation(2 * block_size * HEAD)
    return TokenMap(order.reshape(2, block_size, HEAD))


def write(token_map: TokenMap, values: np.ndarray, first_block: int, blocks: int) -> np.ndarray:
    """Blocks ``first_block ..`` of a prompt whose (K or V, token, dim) hold
    ``values[kv, token, dim]``, in ``token_map``'s format; zeros past the prompt."""
    out = np.zeros((blocks, token_map.elements), dtype=np.uint16)
    for block in range(blocks):
        for position in range(token_map.block_size):
            token = (first_block + block) * token_map.block_size + position
            if token < values.shape[1]:
                out[block, token_map.offsets[:, position, :]] = values[:, token, :]
    return out


def make(kind: str, block_size: int, seed: int) -> TokenMap:
    return transposed_k(block_size) if kind == "transposed" else shuffled(block_size, seed)


@settings(max_examples=60, deadline=None)
@given(st.sampled_from(["transposed", "shuffled"]),
       st.sampled_from([(32, 128), (128, 32), (64, 128), (32, 64), (32, 32)]),
       st.integers(1, 300), st.integers(0, 3), st.integers(0, 1 << 16))
def test_regrouped_blocks_hold_the_same_tokens_as_written_at_that_block_size(
        kind: str, sizes: tuple[int, int], tokens: int, skip: int, seed: int) -> None:
    """What the prefill engine wrote in its blocks ``source_first ..``, regrouped,
    is what the decode engine would have written in its own, for every token
    the push carries; tokens it does not carry come out as zeros."""
    source_size, dest_size = sizes
    source, dest = make(kind, source_size, seed), make(kind, dest_size, seed + 1)
    rng = np.random.default_rng(seed)
    values = rng.integers(1, 1 << 16, (2, tokens, HEAD), dtype=np.uint16)
    source_blocks = -(-tokens // source_size)
    source_first = min(skip, source_blocks - 1)  # a sliding window's first pushed block
    pushed = write(source, values, source_first, source_blocks - source_first)
    dest_blocks = -(-tokens // dest_size)
    dest_first = source_first * source_size // dest_size
    index = regroup_index(source, dest, source_first, source_blocks - source_first,
                          dest_first, dest_blocks - dest_first)
    got = regroup(pushed.tobytes(), 2, plan_gather(index)).view(np.uint16)
    carried = values.copy()
    carried[:, : source_first * source_size, :] = 0  # before the window: not pushed
    assert np.array_equal(got, write(dest, carried, dest_first, dest_blocks - dest_first))


def test_a_map_that_misses_an_element_is_refused() -> None:
    offsets = transposed_k(32).offsets.copy()
    offsets[1, 0, 0] = offsets[0, 0, 0]
    with pytest.raises(ValueError, match="exactly once"):
        TokenMap(offsets)


def test_maps_of_different_head_sizes_are_refused() -> None:
    with pytest.raises(ValueError, match="head sizes differ"):
        regroup_index(TokenMap.token_major(32, 4), TokenMap.token_major(32, 8), 0, 1, 0, 1)


@pytest.mark.parametrize(("source", "dest", "run"), [(128, 32, 32), (32, 128, 32), (64, 128, 64)])
def test_the_kernels_format_moves_in_runs_of_the_smaller_block(source: int, dest: int,
                                                               run: int) -> None:
    """K transposed keeps a dimension's tokens together, V a token's dimensions:
    a gather moves runs of the smaller block size, not single elements."""
    index = regroup_index(transposed_k(source, 64), transposed_k(dest, 64), 0, 4096 // source,
                          0, 4096 // dest)
    assert plan_gather(index).run == run


def test_a_shuffled_format_still_regroups_element_by_element() -> None:
    index = regroup_index(shuffled(32, 1), shuffled(64, 2), 0, 4, 0, 2)
    assert plan_gather(index).run == 1
