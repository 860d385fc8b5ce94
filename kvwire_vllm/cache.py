"""The engine's paged KV cache, seen as (layer, block, head) runs of opaque bytes.

vLLM hands the connector one tensor per attention layer. On the CPU backend
each is ``[num_blocks, kv_heads, block_size, 2 * head_size]`` (an MLA layer:
``[num_blocks, block_size, kv_lora_rank + rope_dim]``, one latent "head").
Inside one head of one block the layout belongs to the attention kernel (on
AVX-512, K transposed, then V), so kvwire never interprets it: a (layer,
block, head) is moved as its bytes, and both engines must agree on
everything that shapes them (kvwire_vllm.shards.EngineLayout), which the
layout fingerprint in every seal checks again. The one difference bridged,
block size, is regrouped with the kernel's own map of a block
(kvwire_vllm.blockmap), never by assuming its format.

Heads lie on the second axis, so one head of a block is one contiguous run:
a push of one head gathers that run from each of the request's blocks.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import torch

from kvwired.errors import ConfigError

from .blockmap import TokenMap, kernel_token_map
from .describe import CacheGroup, EngineCache
from .seal import layout_fingerprint


def block_format(device: str = "cpu") -> str:
    """The attention kernel's private block layout, as far as it can differ
    between two hosts: on the CPU backend it follows the instruction set."""
    if device == "cpu":
        return f"cpu/{torch.backends.cpu.get_cpu_capability()}"
    return device


class KVCacheBlocks:
    """Per layer, the cache as ``[num_blocks, local_heads, head_bytes]`` uint8."""

    def __init__(self, kv_caches: Mapping[str, torch.Tensor], engine: EngineCache) -> None:
        if not kv_caches:
            raise ValueError("vLLM registered no KV cache layers with the connector")
        self.engine = engine
        self.layout = engine.layout
        self.block_size = engine.layout.block_size
        self.fingerprint = layout_fingerprint(engine.layout.key())
        # Layer name -> (its group, its position among the group's layers).
        self.where: dict[str, tuple[CacheGroup, int]] = {}
        self.tensors: dict[str, torch.Tensor] = {}
        for group in engine.groups:
            for position, name in enumerate(group.layer_names):
                if name not in kv_caches:
                    raise ConfigError(f"vLLM registered no KV cache for layer {name} of "
                                      f"KV-cache group {group.index}")
                self.where[name] = (group, position)
                self.tensors[name] = self._heads_view(name, kv_caches[name], group)
        self.num_blocks = min(t.shape[0] for t in self.tensors.values())
        first = next(iter(kv_caches.values()))
        self.dtype = first.dtype
        self.itemsize = first.element_size()

    def token_map(self, block_size: int) -> TokenMap:
        """Where each token of a head lies in a block of ``block_size`` tokens, as
        this engine's attention kernel writes it."""
        return kernel_token_map(self.dtype, block_size, self.layout.head_size)

    @staticmethod
    def _heads_view(name: str, tensor: torch.Tensor, group: CacheGroup) -> torch.Tensor:
        if not tensor.is_contiguous():
            raise ConfigError(f"KV cache layer {name} is not contiguous")
        if group.kind != "mla" and (tensor.dim() < 2 or tensor.shape[1] != group.local_heads):
            raise ConfigError(
                f"KV cache layer {name} is {tuple(tensor.shape)}: kvwire's connector moves "
                f"whole heads of the CPU backend's [num_blocks, kv_heads, block_size, "
                f"2 * head_size], with {group.local_heads} heads on the second axis")
        blocks = tensor.shape[0]
        flat = tensor.view(torch.uint8).view(blocks, -1)
        if flat.shape[1] != group.local_heads * group.head_bytes:
            raise ConfigError(f"KV cache layer {name}: a block is {flat.shape[1]} B, "
                              f"{group.local_heads} heads of {group.head_bytes} B expected")
        return flat.view(blocks, group.local_heads, group.head_bytes)

    def read_head(self, layer: str, head: int, block_ids: torch.Tensor, out: memoryview) -> None:
        """Copy local head ``head`` of blocks ``block_ids`` of ``layer`` into ``out``,
        back to back."""
        cache = self.tensors[layer]
        target = torch.frombuffer(out, dtype=torch.uint8).view(len(block_ids), cache.shape[2])
        if cache.device.type == "cpu":
            torch.index_select(cache[:, head], 0, block_ids, out=target)
        else:  # device to host, into staging (the GPU path; not tested on CPU-only CI)
            target.copy_(cache[:, head].index_select(0, block_ids.to(cache.device)))

    def write_head(self, layer: str, head: int, block_ids: Sequence[int],
                   data: memoryview | np.ndarray) -> None:
        """Copy ``data`` (one head's runs, back to back) into local head ``head`` of
        blocks ``block_ids`` of ``layer``."""
        cache = self.tensors[layer]
        source = np.frombuffer(data, dtype=np.uint8).reshape(len(block_ids), cache.shape[2])
        if cache.device.type == "cpu":
            cache.numpy()[np.asarray(block_ids, dtype=np.int64), head] = source
        else:  # host to device (the GPU path; not tested on CPU-only CI)
            ids = torch.tensor(block_ids, dtype=torch.int64, device=cache.device)
            cache[ids, head] = torch.from_numpy(source.copy()).to(cache.device)
