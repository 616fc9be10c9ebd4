"""A tiny llama-architecture GGUF for tests: random weights, a character-level tokenizer.

A few hundred KB; llama.cpp loads it in well under a second and answers with random
characters, which is all a test of the plumbing needs. Nothing is fetched from a hub.

Every token is a whole character (printable ASCII, tab, newline, the Latin-1 letters, the
SentencePiece space), so any sampled answer is valid UTF-8: with raw byte tokens an answer
could end inside a character, and newer llama.cpp builds answer such a reply with 500.
A prompt may hold only those characters (others have no token to fall back to).
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np

N_EMBD = 64
N_LAYER = 2
N_HEAD = 4
N_FF = 128
N_CTX = 2048
# ChatML: llama-server needs a template to serve /v1/chat/completions.
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _vocab() -> tuple[list[str], list[float], list[int]]:
    import gguf

    ascii_bytes = [0x09, 0x0A, 0x0D, *range(0x20, 0x7F)]
    # Byte tokens for ASCII only: each is a whole character on its own.
    tokens = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in ascii_bytes)]
    types = [gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL, gguf.TokenType.CONTROL]
    types += [gguf.TokenType.BYTE] * len(ascii_bytes)
    # SentencePiece writes a space as U+2581; Latin-1 letters as whole characters.
    characters = ["\u2581", *(chr(c) for c in range(0xA1, 0x100) if c != 0xAD)]
    tokens += characters
    types += [gguf.TokenType.NORMAL] * len(characters)
    return tokens, [0.0] * len(tokens), [int(t) for t in types]


def write_tiny_gguf(path: str | Path, seed: int = 0) -> str:
    """Write the model to path and return its sha256."""
    import gguf

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    tokens, scores, types = _vocab()
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("llmgw-tiny-test")
    w.add_context_length(N_CTX)
    w.add_embedding_length(N_EMBD)
    w.add_block_count(N_LAYER)
    w.add_feed_forward_length(N_FF)
    w.add_head_count(N_HEAD)
    w.add_head_count_kv(N_HEAD)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_dimension_count(N_EMBD // N_HEAD)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_unk_token_id(0)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_add_bos_token(True)
    w.add_chat_template(CHAT_TEMPLATE)

    def tensor(name: str, *shape: int) -> None:
        data = rng.standard_normal(shape).astype(np.float32) * 0.02
        if name.endswith("norm.weight"):
            data = np.ones(shape, dtype=np.float32)
        w.add_tensor(name, data)

    vocab = len(tokens)
    tensor("token_embd.weight", vocab, N_EMBD)
    for i in range(N_LAYER):
        tensor(f"blk.{i}.attn_norm.weight", N_EMBD)
        for part in ("q", "k", "v", "output"):
            tensor(f"blk.{i}.attn_{part}.weight", N_EMBD, N_EMBD)
        tensor(f"blk.{i}.ffn_norm.weight", N_EMBD)
        tensor(f"blk.{i}.ffn_gate.weight", N_FF, N_EMBD)
        tensor(f"blk.{i}.ffn_up.weight", N_FF, N_EMBD)
        tensor(f"blk.{i}.ffn_down.weight", N_EMBD, N_FF)
    tensor("output_norm.weight", N_EMBD)
    tensor("output.weight", vocab, N_EMBD)

    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return hashlib.sha256(path.read_bytes()).hexdigest()


if __name__ == "__main__":
    import sys

    target = sys.argv[1] if len(sys.argv) > 1 else "tiny.gguf"
    print(write_tiny_gguf(target), target)
