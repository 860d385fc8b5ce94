"""Regrouping a head's tokens between two block sizes, inside the kernel's format.

Inside a block the layout is the attention kernel's own (vLLM's CPU backend,
on this instruction set: K transposed, then V), so 128 tokens are not four
blocks of 32 laid end to end. kvwire does not hard-code that format: it asks
the kernel. ``kernel_token_map`` writes tokens tagged with their position
and dimension through vLLM's own cache-writing op into an empty block and
reads back where each element landed. Two such maps (the prefill engine's
block size, this engine's) give a gather from the pushed blocks into this
engine's, done in the copy out of the receive pool that happens anyway.

Only block sizes that divide each other are bridged (the CPU backend's are
multiples of 32), and only between kernels of one format: both maps come
from this engine's kernel, which is why the layouts must agree on the block
format (the CPU's instruction set) for a bridge to be offered at all.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import numpy as np

# Tags are small integers written in the model's dtype: exact in bfloat16 up to 256.
_MAX_TAG = 256


class TokenMap:
    """Where (K or V, token, dimension) of one head lies in one block: an element
    offset per entry of ``offsets`` ``[2, block_size, head_size]``."""

    def __init__(self, offsets: np.ndarray) -> None:
        if offsets.ndim != 3 or offsets.shape[0] != 2:
            raise ValueError(f"a token map is [2, block_size, head_size], not {offsets.shape}")
        elements = offsets.size
        if sorted(offsets.ravel().tolist()) != list(range(elements)):
            raise ValueError("a token map must place every element of the block exactly once")
        self.offsets = offsets.astype(np.int64)
        self.block_size = int(offsets.shape[1])
        self.head_size = int(offsets.shape[2])
        self.elements = elements  # of one head's block

    @classmethod
    def token_major(cls, block_size: int, head_size: int) -> TokenMap:
        """K then V, each ``[block_size, head_size]``."""
        return cls(np.arange(2 * block_size * head_size).reshape(2, block_size, head_size))


def regroup_index(source: TokenMap, dest: TokenMap, source_first: int, source_blocks: int,
                  dest_first: int, dest_blocks: int) -> np.ndarray:
    """For each element of this engine's blocks ``dest_first ..`` (``dest_blocks``
    of them, numbered from the prompt's start), its element in the pushed blocks
    (``source_blocks`` of them, the first being the prompt's ``source_first``),
    flat; -1 where the push has no such token (before a sliding window's first
    pushed block, or past the prompt's last block: tokens nobody reads)."""
    if source.head_size != dest.head_size:
        raise ValueError(f"head sizes differ: {source.head_size} and {dest.head_size}")
    # The prompt's token at each (block, token) of the destination.
    tokens = (np.arange(dest_first, dest_first + dest_blocks)[:, None] * dest.block_size
              + np.arange(dest.block_size)[None, :])
    block = tokens // source.block_size - source_first
    within = tokens % source.block_size
    # [dest_blocks, 2, dest.block_size, head_size]: source element of each.
    found = (block[:, None, :, None] * source.elements
             + source.offsets[:, within, :].transpose(1, 0, 2, 3))
    missing = ((block < 0) | (block >= source_blocks))[:, None, :, None]
    found = np.where(missing, -1, found)
    index = np.empty((dest_blocks, dest.elements), dtype=np.int64)
    index[:, dest.offsets.ravel()] = found.reshape(dest_blocks, -1)
    return index


@dataclass(frozen=True)
class Gather:
    """``regroup_index`` in runs: ``run`` elements that lie back to back in both
    the push and this engine's blocks move as one (on the CPU kernel's format,
    a K dimension's tokens and a V token's dimensions), so the gather costs a
    run's index, not every element's."""

    runs: np.ndarray  # per destination run, the source run; -1: no token there
    run: int  # elements per run
    dest_blocks: int


def plan_gather(index: np.ndarray) -> Gather:
    """The longest runs (a power of two) that ``index`` moves whole: each starts
    at a multiple of the run in the push, is contiguous there, and is present
    or absent as a whole."""
    flat = index.ravel()
    run = 1
    while flat.size % (run * 2) == 0 and run < 1 << 12:
        rows = flat.reshape(-1, run * 2)
        starts = rows[:, 0]
        whole = ((rows == -1).all(axis=1)
                 | ((starts % (run * 2) == 0)
                    & (rows == starts[:, None] + np.arange(run * 2)[None, :]).all(axis=1)))
        if not whole.all():
            break
        run *= 2
    starts = flat.reshape(-1, run)[:, 0]
    return Gather(np.where(starts < 0, -1, starts // run), run, index.shape[0])


def regroup(kv: memoryview | bytes, itemsize: int, gather: Gather) -> np.ndarray:
    """The pushed blocks ``kv`` gathered into this engine's blocks, as bytes
    ``[dest_blocks, block bytes]``; zeros where the push has no token."""
    unit = np.dtype((np.void, gather.run * itemsize))
    runs = np.frombuffer(kv, dtype=np.uint8)
    runs = runs[: runs.size - runs.size % unit.itemsize].view(unit)
    present = gather.runs >= 0
    out = np.zeros(gather.runs.size, dtype=unit)
    out[present] = runs[gather.runs[present]]
    return out.view(np.uint8).reshape(gather.dest_blocks, -1)


@functools.lru_cache(maxsize=16)
def kernel_token_map(dtype: Any, block_size: int, head_size: int) -> TokenMap:
    """The CPU attention kernel's layout of one head's block, learned from the
    kernel: every token's K and V written through vLLM's cache-writing op,
    tagged first with its position, then with its dimension."""
    import torch
    from vllm import _custom_ops as ops
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    if block_size > _MAX_TAG or head_size > _MAX_TAG:
        raise ValueError(f"block size {block_size} or head size {head_size} is past "
                         f"{_MAX_TAG}, which the tags cannot tell apart")
    isa = _get_attn_isa(dtype, block_size, head_size)
    cache = torch.zeros(1, 1, block_size, 2 * head_size, dtype=dtype)
    # The backend's own view: [blocks, heads, 2 * block_size, head_size], K then V.
    key_cache, value_cache = cache.view(1, 1, 2 * block_size, head_size).chunk(2, dim=2)
    slots = torch.arange(block_size, dtype=torch.int64)
    tags = []
    for axis in (0, 2):
        shape = [block_size, 1, head_size]
        tag = torch.arange(1, shape[axis] + 1, dtype=torch.float32).view(
            [-1 if n == axis else 1 for n in range(3)]).expand(shape).to(dtype).contiguous()
        cache.zero_()
        # K tagged positive, V negative: which half each element is.
        ops.cpu_attn_reshape_and_cache(tag, -tag, key_cache, value_cache, slots, isa,
                                       k_scale=1.0, v_scale=1.0, kv_cache_dtype="auto")
        tags.append(cache.view(-1).float().numpy().astype(np.int64))
    token, dimension = tags
    offsets = np.empty((2, block_size, head_size), dtype=np.int64)
    where = np.arange(token.size)
    half = (token < 0).astype(np.int64)
    offsets[half, np.abs(token) - 1, np.abs(dimension) - 1] = where
    return TokenMap(offsets)
