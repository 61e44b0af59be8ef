"""A random-weight tiny Llama with a character-level tokenizer, built in code for tests.

Deterministic from ``seed``; saved as a Hugging Face model folder that loads offline.
"""

from __future__ import annotations

from pathlib import Path

SPECIALS = ("<pad>", "<bos>", "<unk>", "<|user|>", "<|assistant|>", "<|end|>")
CHARS = ("\n", *(chr(i) for i in range(32, 127)))


def build_tokenizer():  # type: ignore[no-untyped-def]
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {token: index for index, token in enumerate((*SPECIALS, *CHARS))}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    backend.decoder = decoders.Fuse()
    backend.add_special_tokens([AddedToken(token, special=True, normalized=False) for token in SPECIALS])
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="<pad>", bos_token="<bos>", unk_token="<unk>",
        eos_token="<|end|>", clean_up_tokenization_spaces=False,
    )


def build_tiny_model(out: Path, *, seed: int = 1234, max_positions: int = 256) -> Path:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = build_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_positions,
        tie_word_embeddings=False, initializer_range=0.3, pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out
