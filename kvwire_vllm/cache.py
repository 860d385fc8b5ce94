"""The engine's paged KV cache, seen as whole blocks of opaque bytes.

vLLM hands the connector one tensor per attention layer. On the CPU backend
each is ``[num_blocks, kv_heads, block_size, 2 * head_size]``; inside a block
the layout belongs to the attention kernel (on AVX-512, K transposed, then
V), so kvwire never interprets it: a (layer, block) is moved as its bytes,
and both engines must agree on everything that shapes them, which the
layout fingerprint in every seal checks.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence

import numpy as np
import torch

from .seal import layout_fingerprint

_LAYER_INDEX = re.compile(r"layers\.(\d+)\.")


class KVCacheBlocks:
    """Per layer, the cache as ``[num_blocks, block_bytes]`` uint8, in layer order."""

    def __init__(self, kv_caches: Mapping[str, torch.Tensor], block_size: int) -> None:
        if not kv_caches:
            raise ValueError("vLLM registered no KV cache layers with the connector")
        names = list(kv_caches)
        if all(_LAYER_INDEX.search(name) for name in names):
            names.sort(key=lambda name: int(_LAYER_INDEX.search(name).group(1)))  # type: ignore[union-attr]
        self.names = names
        self.index = {name: n for n, name in enumerate(names)}
        first = kv_caches[names[0]]
        self.block_size = block_size
        self.block_bytes = first[0].numel() * first.element_size()
        self.tensors: list[torch.Tensor] = []
        for name in names:
            tensor = kv_caches[name]
            if tensor.shape != first.shape or tensor.dtype != first.dtype:
                raise ValueError(f"KV cache layer {name} is {tuple(tensor.shape)} "
                                 f"{tensor.dtype}, unlike {names[0]}: kvwire moves "
                                 "uniform layers only (no hybrid or MLA caches yet)")
            if not tensor.is_contiguous():
                raise ValueError(f"KV cache layer {name} is not contiguous")
            self.tensors.append(tensor.view(torch.uint8).view(tensor.shape[0], -1))
        self.num_blocks = first.shape[0]
        self.layout = layout_fingerprint("|".join([
            str(first.dtype), str(tuple(first.shape[1:])), str(block_size),
            str(first.device.type), torch.backends.cpu.get_cpu_capability()]))

    @property
    def layers(self) -> int:
        return len(self.tensors)

    def read_blocks(self, layer: int, block_ids: torch.Tensor, out: memoryview) -> None:
        """Copy blocks ``block_ids`` of ``layer`` into ``out``, back to back."""
        target = torch.frombuffer(out, dtype=torch.uint8).view(len(block_ids), self.block_bytes)
        cache = self.tensors[layer]
        if cache.device.type == "cpu":
            torch.index_select(cache, 0, block_ids, out=target)
        else:  # device to host, into staging (the GPU path; not tested on CPU-only CI)
            target.copy_(cache.index_select(0, block_ids.to(cache.device)))

    def write_blocks(self, layer: int, block_ids: Sequence[int], data: memoryview) -> None:
        """Copy ``data`` (blocks back to back) into blocks ``block_ids`` of ``layer``."""
        source = np.frombuffer(data, dtype=np.uint8).reshape(len(block_ids), self.block_bytes)
        cache = self.tensors[layer]
        if cache.device.type == "cpu":
            cache.numpy()[np.asarray(block_ids, dtype=np.int64)] = source
        else:  # host to device (the GPU path; not tested on CPU-only CI)
            ids = torch.tensor(block_ids, dtype=torch.int64, device=cache.device)
            cache[ids] = torch.from_numpy(source.copy()).to(cache.device)
