"""Model geometries for ``kvtier bench`` (both modes: one host, and two clients with
--node-b): bytes per KV-cache block from each model's public Hugging Face config.json."""
from __future__ import annotations

from dataclasses import dataclass

DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4, "fp8": 1, "float8_e4m3fn": 1}


@dataclass(frozen=True)
class Preset:
    """KV geometry of a model, from the fields of its public Hugging Face config.json."""

    model: str
    layers: int  # num_hidden_layers
    kv_heads: int  # num_key_value_heads
    head_dim: int  # head_dim, or hidden_size / num_attention_heads
    dtype: str  # torch_dtype
    source: str

    def block_bytes(self, tokens: int) -> int:
        """Bytes of one block of ``tokens`` tokens: 2 (K,V) * layers * kv_heads * head_dim * dtype bytes * tokens."""
        return 2 * self.layers * self.kv_heads * self.head_dim * DTYPE_BYTES[self.dtype] * tokens


PRESETS = {
    # https://huggingface.co/meta-llama/Llama-3.1-8B/blob/main/config.json
    "llama-3.1-8b": Preset(
        "meta-llama/Llama-3.1-8B", 32, 8, 128, "bfloat16",
        "num_hidden_layers=32, num_key_value_heads=8, hidden_size=4096 / num_attention_heads=32 "
        "= head_dim 128, torch_dtype=bfloat16"),
    # https://huggingface.co/meta-llama/Llama-3.1-70B/blob/main/config.json
    "llama-3.1-70b": Preset(
        "meta-llama/Llama-3.1-70B", 80, 8, 128, "bfloat16",
        "num_hidden_layers=80, num_key_value_heads=8, hidden_size=8192 / num_attention_heads=64 "
        "= head_dim 128, torch_dtype=bfloat16"),
    # https://huggingface.co/Qwen/Qwen3-8B/blob/main/config.json
    "qwen3-8b": Preset(
        "Qwen/Qwen3-8B", 36, 8, 128, "bfloat16",
        "num_hidden_layers=36, num_key_value_heads=8, head_dim=128, torch_dtype=bfloat16"),
    # https://huggingface.co/Qwen/Qwen3-0.6B/blob/main/config.json
    "qwen3-0.6b": Preset(
        "Qwen/Qwen3-0.6B", 28, 8, 128, "bfloat16",
        "num_hidden_layers=28, num_key_value_heads=8, head_dim=128, torch_dtype=bfloat16"),
    # https://huggingface.co/mistralai/Mistral-7B-v0.3/blob/main/config.json
    "mistral-7b": Preset(
        "mistralai/Mistral-7B-v0.3", 32, 8, 128, "bfloat16",
        "num_hidden_layers=32, num_key_value_heads=8, hidden_size=4096 / num_attention_heads=32 "
        "= head_dim 128, torch_dtype=bfloat16"),
    # not a real model: small blocks for tests and smoke runs
    "tiny": Preset("kvtier/tiny", 2, 2, 64, "float16", "test geometry: 2 layers, 2 KV heads, head_dim 64, float16"),
}
DEFAULT_PRESET = "llama-3.1-8b"
