"""KV caches to push: a synthetic Qwen2.5-0.5B-shaped one, or one from a file."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np

from kvwired.errors import ConfigError
from kvwired.layout import KVLayout, RequestShape


def synthetic(layout: KVLayout, seed: int = 0) -> np.ndarray:
    """Normally distributed values shaped (layers, tokens, K/V, kv_heads, head_dim).

    Drawing 24 M normal samples takes seconds on an emulated lab node, so the
    values are drawn from a sorted table of 65,536 normal samples by random
    16-bit index: the same distribution, ten times faster, and a given seed
    gives the same cache on every node.
    """
    rng = np.random.default_rng(seed)
    shape = (layout.layers, layout.tokens, 2, layout.kv_heads, layout.head_dim)
    dtype = {1: np.int8, 2: np.float16, 4: np.float32}[layout.dtype_bytes]
    table = np.sort(rng.standard_normal(1 << 16, dtype=np.float32))
    if dtype is np.int8:
        table = np.clip(table * 32, -127, 127)
    indices = rng.integers(0, 1 << 16, size=int(np.prod(shape)), dtype=np.uint16)
    return table.astype(dtype)[indices].reshape(shape)


def from_file(path: str) -> tuple[RequestShape, np.ndarray]:
    """Load a cache: ``.npy`` (first axis = layers) or ``.safetensors`` (one tensor a layer)."""
    file = Path(path)
    if not file.exists():
        raise ConfigError(f"{path} does not exist")
    if file.suffix == ".npy":
        try:
            array = np.load(file, mmap_mode="r", allow_pickle=False)
        except ValueError as exc:
            raise ConfigError(f"{path} is not a plain .npy array: {exc}") from exc
        layers = array.shape[0] if array.ndim >= 2 else 1
        flat = np.ascontiguousarray(array).reshape(-1).view(np.uint8)
        return RequestShape(layers, flat.nbytes // layers), flat
    if file.suffix == ".safetensors":
        from safetensors.numpy import load_file

        tensors = load_file(str(file))
        if not tensors:
            raise ConfigError(f"{path} holds no tensors")
        names = sorted(tensors, key=_natural)
        sizes = {tensors[n].nbytes for n in names}
        if len(sizes) != 1:
            raise ConfigError(
                f"{path}: tensors differ in size ({sorted(sizes)} B)",
                hint="each tensor is pushed as one layer, so all must be the same size",
            )
        flat = np.concatenate([np.ascontiguousarray(tensors[n]).reshape(-1).view(np.uint8)
                               for n in names])
        return RequestShape(len(names), sizes.pop()), flat
    raise ConfigError(f"cannot read {path}", hint="give a .npy or .safetensors file")


def _natural(name: str) -> list[object]:
    """"layers.10.k" after "layers.9.k"."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)]


def synthetic_bytes(length: int, seed: int) -> bytes:
    """``length`` seeded random bytes: a cache of any shape whose every byte a
    receiver can check, given the seed."""
    return np.random.default_rng(seed).bytes(length)
