"""A small random-weight Llama written as GGUF: a real model file for real engines, without a model hub.

The architecture is Llama's (what llama.cpp, vLLM and transformers all load); the weights are seeded
normal draws, so the file is the same on every machine and its outputs are finite gibberish. The
tokenizer is copied from llama.cpp's vocabulary-only file (the 32,000-token Llama SentencePiece
vocabulary), so prompts tokenize the way a real Llama-2 model's would.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np

# A chat template in the file itself, so both engines format chat requests the same way (the
# vocabulary file has none, and transformers refuses chat requests without one). ChatML is plain text
# to this vocabulary, which is fine for a model that only has to produce tokens.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


@dataclass(frozen=True, slots=True)
class TinyLlamaShape:
    num_layers: int = 6
    width: int = 384
    num_heads: int = 6
    num_kv_heads: int = 2
    ffn_width: int = 1024
    context_tokens: int = 2048
    weight_std: float = 0.02  # small enough that activations stay finite through every layer

    @property
    def head_dim(self) -> int:
        return self.width // self.num_heads


@dataclass(frozen=True, slots=True)
class TokenizerField:
    """One ``tokenizer.*`` key of a GGUF file, as its writer takes it back."""

    key: str
    value: Any
    value_type: gguf.GGUFValueType
    sub_type: gguf.GGUFValueType | None  # the element type of an array


def read_tokenizer(path: Path) -> list[TokenizerField]:
    """The tokenizer fields of a GGUF file (a vocabulary-only file, or a model). Takes seconds: the reader
    parses each of the 32,000 token strings."""
    fields = []
    for key, field in gguf.GGUFReader(path).fields.items():
        if key.startswith("tokenizer."):
            sub_type = field.types[1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
            fields.append(TokenizerField(key, field.contents(), field.types[0], sub_type))
    return fields


def write_tiny_llama(path: Path, tokenizer: Sequence[TokenizerField], name: str, seed: int = 0,
                     shape: TinyLlamaShape = TinyLlamaShape()) -> int:
    """Write the model to ``path``; returns its parameter count."""
    num_vocab = next(len(field.value) for field in tokenizer if field.key == "tokenizer.ggml.tokens")
    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_name(name)
    writer.add_context_length(shape.context_tokens)
    writer.add_embedding_length(shape.width)
    writer.add_block_count(shape.num_layers)
    writer.add_feed_forward_length(shape.ffn_width)
    writer.add_head_count(shape.num_heads)
    writer.add_head_count_kv(shape.num_kv_heads)
    writer.add_rope_dimension_count(shape.head_dim)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(num_vocab)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    for field in tokenizer:
        if field.key != "tokenizer.chat_template":  # ours is added below
            writer.add_key_value(field.key, field.value, field.value_type, field.sub_type)
    writer.add_chat_template(CHAT_TEMPLATE)

    num_params = 0

    def matrix(tensor: str, rows: int, cols: int) -> None:
        # (rows, cols) is (out, in), PyTorch's order; GGUF stores the dimensions reversed.
        nonlocal num_params
        weights = rng.standard_normal((rows, cols), dtype=np.float32) * np.float32(shape.weight_std)
        writer.add_tensor(tensor, weights.astype(np.float16))
        num_params += rows * cols

    def norm(tensor: str) -> None:
        nonlocal num_params
        writer.add_tensor(tensor, np.ones(shape.width, dtype=np.float32))  # llama.cpp wants norms in F32
        num_params += shape.width

    kv_width = shape.num_kv_heads * shape.head_dim
    matrix("token_embd.weight", num_vocab, shape.width)
    for layer in range(shape.num_layers):
        block = f"blk.{layer}"
        norm(f"{block}.attn_norm.weight")
        matrix(f"{block}.attn_q.weight", shape.width, shape.width)
        matrix(f"{block}.attn_k.weight", kv_width, shape.width)
        matrix(f"{block}.attn_v.weight", kv_width, shape.width)
        matrix(f"{block}.attn_output.weight", shape.width, shape.width)
        norm(f"{block}.ffn_norm.weight")
        matrix(f"{block}.ffn_gate.weight", shape.ffn_width, shape.width)
        matrix(f"{block}.ffn_up.weight", shape.ffn_width, shape.width)
        matrix(f"{block}.ffn_down.weight", shape.width, shape.ffn_width)
    norm("output_norm.weight")
    matrix("output.weight", num_vocab, shape.width)

    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return num_params
