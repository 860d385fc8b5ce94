"""A small Llama-architecture model made on this machine: no hub, no download.

The connector's tests and demo need a model whose greedy tokens depend on
every byte of the KV cache, so that KV loaded wrong shows as wrong tokens.
Weights drawn from a seeded generator do that (vLLM's ``load_format=dummy``
does not: its near-zero weights loop on two tokens whatever the context).

Two shapes:
- ``tiny``: 2 layers, 2 KV heads x 32, float32; 64 KiB per (layer, block) of
  128 tokens. Builds in about a second; the tests use it.
- ``bench``: 8 layers, 8 KV heads x 64, float32; 32 KiB of KV per token
  (about 32 MiB for a 1,000-token prompt). Its transfer times are large
  enough to see next to its prefill compute; the benchmark uses it.

Only numpy and safetensors: the daemons' environment can make a model too.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

# The token ids the model's config names: prompts avoid them.
BOS, EOS = 1, 2


@dataclass(frozen=True)
class ModelShape:
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int = 1024
    max_positions: int = 8192

    def kv_bytes_per_token(self, itemsize: int = 4) -> int:
        """K and V of one token across all layers."""
        return 2 * self.layers * self.kv_heads * self.head_dim * itemsize


SHAPES = {
    "tiny": ModelShape(layers=2, hidden=128, heads=4, kv_heads=2, head_dim=32,
                       intermediate=256),
    "bench": ModelShape(layers=8, hidden=512, heads=8, kv_heads=8, head_dim=64,
                        intermediate=1024),
}
# Large enough for context-dependent, non-repeating greedy output; small
# enough that activations stay finite in float32 through the layers.
WEIGHT_STD = 0.2
MARKER = "kvwire-model.json"  # written last: a directory without it is incomplete


def config(shape: ModelShape) -> dict[str, object]:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": shape.hidden,
        "intermediate_size": shape.intermediate,
        "num_hidden_layers": shape.layers,
        "num_attention_heads": shape.heads,
        "num_key_value_heads": shape.kv_heads,
        "head_dim": shape.head_dim,
        "vocab_size": shape.vocab,
        "max_position_embeddings": shape.max_positions,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        "bos_token_id": BOS,
        "eos_token_id": EOS,
    }


def weights(shape: ModelShape, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)

    def matrix(rows: int, cols: int) -> np.ndarray:
        return (rng.standard_normal((rows, cols), dtype=np.float32) * WEIGHT_STD)

    h, q, kv = shape.hidden, shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    tensors = {"model.embed_tokens.weight": matrix(shape.vocab, h),
               "model.norm.weight": np.ones(h, dtype=np.float32),
               "lm_head.weight": matrix(shape.vocab, h)}
    for i in range(shape.layers):
        prefix = f"model.layers.{i}"
        tensors |= {
            f"{prefix}.self_attn.q_proj.weight": matrix(q, h),
            f"{prefix}.self_attn.k_proj.weight": matrix(kv, h),
            f"{prefix}.self_attn.v_proj.weight": matrix(kv, h),
            f"{prefix}.self_attn.o_proj.weight": matrix(h, q),
            f"{prefix}.mlp.gate_proj.weight": matrix(shape.intermediate, h),
            f"{prefix}.mlp.up_proj.weight": matrix(shape.intermediate, h),
            f"{prefix}.mlp.down_proj.weight": matrix(h, shape.intermediate),
            f"{prefix}.input_layernorm.weight": np.ones(h, dtype=np.float32),
            f"{prefix}.post_attention_layernorm.weight": np.ones(h, dtype=np.float32),
        }
    return tensors


def make_model(out: Path, name: str = "tiny", seed: int = 0) -> Path:
    """Write model ``name`` into ``out`` (once: an existing complete one is kept)."""
    if name not in SHAPES:
        raise ValueError(f"no model shape {name!r}; choose one of {', '.join(SHAPES)}")
    shape = SHAPES[name]
    identity = {"shape": name, "seed": seed, "std": WEIGHT_STD}
    marker = out / MARKER
    if marker.exists() and json.loads(marker.read_text()) == identity:
        return out
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config(shape), indent=2) + "\n")
    (out / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": BOS, "eos_token_id": EOS, "do_sample": False}, indent=2) + "\n")
    save_file(weights(shape, seed), str(out / "model.safetensors"))
    marker.write_text(json.dumps(identity) + "\n")
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="directory to write the model into")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    print(make_model(args.out, args.shape, args.seed))


if __name__ == "__main__":
    main()
