"""The tiny Llama's GGUF weights as a Hugging Face folder's ``config.json`` and ``model.safetensors``.

vLLM loads Hugging Face folders. transformers can read a GGUF, but the version vLLM pins keeps GGUF
weights packed and refuses to save them, so the weights are copied here with numpy: renamed to
``LlamaForCausalLM``'s names, with llama.cpp's Q/K row order undone, and written in the safetensors
layout (a length-prefixed JSON header of names, dtypes, shapes and byte ranges, then the raw tensors).
The tokenizer files come from transformers (see ``install.tiny_model_hf``).
"""

from __future__ import annotations

import json
import re
import struct
from pathlib import Path

import gguf
import numpy as np

_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_SAFETENSORS_DTYPES = {np.dtype(np.float16): "F16", np.dtype(np.float32): "F32"}


def _field(reader: gguf.GGUFReader, key: str) -> int | float:
    value = reader.fields[key].contents()
    assert isinstance(value, (int, float)), key
    return value


def _hf_name(gguf_name: str) -> str:
    stem = gguf_name.removesuffix(".weight")
    layer = re.fullmatch(r"blk\.(\d+)\.(\w+)", stem)
    if layer:
        return f"model.layers.{layer[1]}.{_LAYER_NAMES[layer[2]]}.weight"
    return f"{_TOP_NAMES[stem]}.weight"


def _unpermute(rows: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's conversion, which interleaves each head's rotary halves for its RoPE kernel."""
    half_head = rows.shape[0] // num_heads // 2
    return rows.reshape(num_heads, half_head, 2, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)


def write_hf_llama(gguf_path: Path, out_dir: Path) -> None:
    """Write ``config.json`` and ``model.safetensors`` for the Llama in ``gguf_path`` into ``out_dir``."""
    reader = gguf.GGUFReader(gguf_path)
    num_heads = int(_field(reader, "llama.attention.head_count"))
    num_kv_heads = int(_field(reader, "llama.attention.head_count_kv"))
    width = int(_field(reader, "llama.embedding_length"))
    tensors: dict[str, np.ndarray] = {}
    for tensor in reader.tensors:
        data = np.asarray(tensor.data)  # numpy order: (out, in), as PyTorch's
        if tensor.name.endswith("attn_q.weight"):
            data = _unpermute(data, num_heads)
        elif tensor.name.endswith("attn_k.weight"):
            data = _unpermute(data, num_kv_heads)
        tensors[_hf_name(tensor.name)] = data
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": tensors["model.embed_tokens.weight"].shape[0],
        "hidden_size": width,
        "intermediate_size": int(_field(reader, "llama.feed_forward_length")),
        "num_hidden_layers": int(_field(reader, "llama.block_count")),
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads,
        "head_dim": width // num_heads,
        "max_position_embeddings": int(_field(reader, "llama.context_length")),
        "rms_norm_eps": float(_field(reader, "llama.attention.layer_norm_rms_epsilon")),
        "rope_theta": float(_field(reader, "llama.rope.freq_base")),
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "bos_token_id": int(_field(reader, "tokenizer.ggml.bos_token_id")),
        "eos_token_id": int(_field(reader, "tokenizer.ggml.eos_token_id")),
        "torch_dtype": "float16",
    }
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    _write_safetensors(out_dir / "model.safetensors", tensors)


def _write_safetensors(path: Path, tensors: dict[str, np.ndarray]) -> None:
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, data in tensors.items():
        header[name] = {"dtype": _SAFETENSORS_DTYPES[data.dtype], "shape": list(data.shape), "data_offsets": [offset, offset + data.nbytes]}
        offset += data.nbytes
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # the format asks the tensors to start 8-byte aligned
    with open(path, "wb") as out:
        out.write(struct.pack("<Q", len(encoded)))
        out.write(encoded)
        for data in tensors.values():
            out.write(np.ascontiguousarray(data, dtype=data.dtype.newbyteorder("<")).tobytes())
