from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from kvctl.source import from_file, synthetic
from kvwired.errors import ConfigError
from kvwired.layout import KVLayout


def test_synthetic_cache_has_the_kvwire_layout() -> None:
    layout = KVLayout(layers=3, tokens=16)
    cache = synthetic(layout, seed=1)
    assert cache.dtype == np.float16
    assert cache.nbytes == layout.total_bytes
    assert cache.shape == (3, 16, 2, 2, 64)
    assert np.array_equal(cache, synthetic(layout, seed=1))


def test_npy_first_axis_is_layers(tmp_path: Path) -> None:
    array = np.arange(4 * 6, dtype=np.float16).reshape(4, 6)
    np.save(tmp_path / "kv.npy", array)
    shape, data = from_file(str(tmp_path / "kv.npy"))
    assert (shape.layers, shape.layer_bytes) == (4, 12)
    assert data.tobytes() == array.tobytes()


def test_safetensors_one_tensor_a_layer_in_natural_order(tmp_path: Path) -> None:
    tensors = {f"layers.{n}.kv": np.full((2, 3), n, dtype=np.float16) for n in range(11)}
    save_file(tensors, str(tmp_path / "kv.safetensors"))
    shape, data = from_file(str(tmp_path / "kv.safetensors"))
    assert (shape.layers, shape.layer_bytes) == (11, 12)
    expected = b"".join(tensors[f"layers.{n}.kv"].tobytes() for n in range(11))
    assert data.tobytes() == expected  # layers.10 after layers.9, not after layers.1


def test_unusable_files_are_explained(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        from_file(str(tmp_path / "missing.npy"))
    (tmp_path / "kv.pt").write_bytes(b"x")
    with pytest.raises(ConfigError, match=r"\.npy or \.safetensors"):
        from_file(str(tmp_path / "kv.pt"))
    save_file({"a": np.zeros(2, np.float16), "b": np.zeros(3, np.float16)},
              str(tmp_path / "ragged.safetensors"))
    with pytest.raises(ConfigError, match="same size"):
        from_file(str(tmp_path / "ragged.safetensors"))
