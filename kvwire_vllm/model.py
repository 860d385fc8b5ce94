"""A small Llama-architecture model made on this machine: no hub, no download.

The connector's tests and demo need a model whose greedy tokens depend on
every byte of the KV cache, so that KV loaded wrong shows as wrong tokens.
Weights drawn from a seeded generator do that (vLLM's ``load_format=dummy``
does not: its near-zero weights loop on two tokens whatever the context).

The shapes:
- ``tiny``: 2 layers, 2 KV heads x 32, float32; 64 KiB per (layer, block) of
  128 tokens. Builds in about a second; the tests use it.
- ``bench``: 8 layers, 8 KV heads x 64, float32; 32 KiB of KV per token
  (about 32 MiB for a 1,000-token prompt). Its transfer times are large
  enough to see next to its prefill compute; the benchmark uses it.
- ``mla``: DeepSeek-V2-shaped (MLA), 2 dense layers, 4 heads, a latent cache
  of 512 + 64 per token (the sizes the CPU MLA kernel takes).
- ``hybrid``: Gemma-3-shaped, a sliding-window layer (window 64) and a full
  one: two KV-cache groups.

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
    architecture: str = "llama"  # llama, deepseek_v2 (MLA) or gemma3 (hybrid)
    # MLA: the latent cache is kv_lora_rank + rope_dim per token, one "head".
    kv_lora_rank: int = 0
    rope_dim: int = 0
    sliding_window: int = 0  # gemma3: the first layer's window

    def kv_bytes_per_token(self, itemsize: int = 4) -> int:
        """The cache of one token across all layers (K and V, or MLA's latent)."""
        if self.architecture == "deepseek_v2":
            return self.layers * (self.kv_lora_rank + self.rope_dim) * itemsize
        return 2 * self.layers * self.kv_heads * self.head_dim * itemsize


SHAPES = {
    "tiny": ModelShape(layers=2, hidden=128, heads=4, kv_heads=2, head_dim=32,
                       intermediate=256),
    "bench": ModelShape(layers=8, hidden=512, heads=8, kv_heads=8, head_dim=64,
                        intermediate=1024),
    # head_dim is the query/key "nope" part; v_head_dim equals it.
    "mla": ModelShape(layers=2, hidden=256, heads=4, kv_heads=1, head_dim=32,
                      intermediate=512, architecture="deepseek_v2", kv_lora_rank=512,
                      rope_dim=64),
    "hybrid": ModelShape(layers=2, hidden=128, heads=4, kv_heads=2, head_dim=32,
                         intermediate=256, architecture="gemma3", sliding_window=64),
}
# Large enough for context-dependent, non-repeating greedy output; small
# enough that activations stay finite in float32 through the layers.
WEIGHT_STD = 0.2
MARKER = "kvwire-model.json"  # written last: a directory without it is incomplete


def config(shape: ModelShape) -> dict[str, object]:
    if shape.architecture == "deepseek_v2":
        return _deepseek_config(shape)
    if shape.architecture == "gemma3":
        return _gemma3_config(shape)
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


def _common(shape: ModelShape) -> dict[str, object]:
    return {
        "hidden_size": shape.hidden,
        "intermediate_size": shape.intermediate,
        "num_hidden_layers": shape.layers,
        "num_attention_heads": shape.heads,
        "vocab_size": shape.vocab,
        "max_position_embeddings": shape.max_positions,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "torch_dtype": "float32",
        "bos_token_id": BOS,
        "eos_token_id": EOS,
    }


def _deepseek_config(shape: ModelShape) -> dict[str, object]:
    """Dense layers only (``first_k_dense_replace`` = the layer count), though
    vLLM's parser wants the MoE counts as integers all the same."""
    return {**_common(shape),
            "architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2",
            "num_key_value_heads": shape.heads,
            "kv_lora_rank": shape.kv_lora_rank, "q_lora_rank": None,
            "qk_rope_head_dim": shape.rope_dim, "qk_nope_head_dim": shape.head_dim,
            "v_head_dim": shape.head_dim, "hidden_act": "silu",
            "first_k_dense_replace": shape.layers, "moe_layer_freq": 1,
            "n_routed_experts": 4, "n_shared_experts": 1, "num_experts_per_tok": 2,
            "moe_intermediate_size": shape.intermediate, "n_group": 1, "topk_group": 1,
            "topk_method": "greedy", "norm_topk_prob": False, "scoring_func": "softmax",
            "routed_scaling_factor": 1.0, "rope_scaling": None,
            "tie_word_embeddings": False}


def _gemma3_config(shape: ModelShape) -> dict[str, object]:
    """A sliding-window layer, then full attention ones."""
    types = ["sliding_attention"] + ["full_attention"] * (shape.layers - 1)
    return {**_common(shape),
            "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text",
            "num_key_value_heads": shape.kv_heads, "head_dim": shape.head_dim,
            "sliding_window": shape.sliding_window, "layer_types": types,
            "query_pre_attn_scalar": shape.head_dim, "rope_local_base_freq": 10000.0,
            "hidden_activation": "gelu_pytorch_tanh", "final_logit_softcapping": None,
            "attn_logit_softcapping": None, "rope_scaling": None,
            "tie_word_embeddings": True}


def weights(shape: ModelShape, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)

    def matrix(rows: int, cols: int) -> np.ndarray:
        return (rng.standard_normal((rows, cols), dtype=np.float32) * WEIGHT_STD)

    def ones(n: int) -> np.ndarray:
        return np.ones(n, dtype=np.float32)

    h, q, kv = shape.hidden, shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    embedding = matrix(shape.vocab, h)
    if shape.architecture == "gemma3":
        # Gemma scales its (tied) embedding by sqrt(hidden): at full size the
        # input token outweighs the layers and the output repeats it.
        embedding /= np.float32(np.sqrt(h))
    tensors = {"model.embed_tokens.weight": embedding, "model.norm.weight": ones(h)}
    if shape.architecture != "gemma3":  # Gemma ties its output to the embedding
        tensors["lm_head.weight"] = matrix(shape.vocab, h)
    for i in range(shape.layers):
        prefix = f"model.layers.{i}"
        tensors |= {
            f"{prefix}.self_attn.o_proj.weight": matrix(h, q),
            f"{prefix}.mlp.gate_proj.weight": matrix(shape.intermediate, h),
            f"{prefix}.mlp.up_proj.weight": matrix(shape.intermediate, h),
            f"{prefix}.mlp.down_proj.weight": matrix(h, shape.intermediate),
            f"{prefix}.input_layernorm.weight": ones(h),
            f"{prefix}.post_attention_layernorm.weight": ones(h),
        }
        if shape.architecture == "deepseek_v2":
            latent, rope = shape.kv_lora_rank, shape.rope_dim
            tensors |= {
                f"{prefix}.self_attn.q_proj.weight": matrix(shape.heads * (shape.head_dim
                                                                           + rope), h),
                f"{prefix}.self_attn.kv_a_proj_with_mqa.weight": matrix(latent + rope, h),
                f"{prefix}.self_attn.kv_a_layernorm.weight": ones(latent),
                f"{prefix}.self_attn.kv_b_proj.weight": matrix(2 * q, latent),
            }
            continue
        tensors |= {
            f"{prefix}.self_attn.q_proj.weight": matrix(q, h),
            f"{prefix}.self_attn.k_proj.weight": matrix(kv, h),
            f"{prefix}.self_attn.v_proj.weight": matrix(kv, h),
        }
        if shape.architecture == "gemma3":
            # Gemma's norms scale by (1 + weight): zeros keep them neutral.
            tensors |= {
                f"{prefix}.self_attn.q_norm.weight": np.zeros(shape.head_dim, np.float32),
                f"{prefix}.self_attn.k_norm.weight": np.zeros(shape.head_dim, np.float32),
                f"{prefix}.pre_feedforward_layernorm.weight": np.zeros(h, np.float32),
                f"{prefix}.post_feedforward_layernorm.weight": np.zeros(h, np.float32),
                f"{prefix}.input_layernorm.weight": np.zeros(h, np.float32),
                f"{prefix}.post_attention_layernorm.weight": np.zeros(h, np.float32),
            }
    if shape.architecture == "gemma3":
        tensors["model.norm.weight"] = np.zeros(h, np.float32)
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
