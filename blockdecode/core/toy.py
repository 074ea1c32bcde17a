"""Small random-weight models built from configs: nothing is downloaded.

Weights drawn wider than the usual init (std 0.02 makes a tiny model repeat one token)
give varied greedy continuations, which is what exactness tests and loop benchmarks need.
"""

from __future__ import annotations

import torch
from transformers import (
    AutoModelForCausalLM,
    AutoModelForSeq2SeqLM,
    BartConfig,
    Gemma3TextConfig,
    GPT2Config,
    GPTNeoXConfig,
    LlamaConfig,
    MarianConfig,
    MistralConfig,
    OPTConfig,
    PhiConfig,
    PretrainedConfig,
    PreTrainedModel,
    Qwen2Config,
    T5Config,
)


def toy_config(arch: str, vocab: int = 512, width: int = 64, layers: int = 2, heads: int = 4, context: int = 512):
    """A config of architecture `arch` at the given size."""
    common = dict(vocab_size=vocab, bos_token_id=0, eos_token_id=1, pad_token_id=1)
    llama_like = dict(
        hidden_size=width,
        intermediate_size=2 * width,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        max_position_embeddings=context,
        **common,
    )
    # Encoder-decoders start their decoders with the pad token, as Marian, BART and T5 do.
    seq2seq = dict(common, pad_token_id=2, decoder_start_token_id=2)
    bart_like = dict(
        forced_eos_token_id=1,  # as the real checkpoints set it
        tie_word_embeddings=False,  # tied, these random post-norm decoders repeat one token
        d_model=width,
        encoder_layers=layers,
        decoder_layers=layers,
        encoder_attention_heads=heads,
        decoder_attention_heads=heads,
        encoder_ffn_dim=2 * width,
        decoder_ffn_dim=2 * width,
        max_position_embeddings=context,
        **seq2seq,
    )
    builders: dict[str, PretrainedConfig] = {
        "gpt2": lambda: GPT2Config(n_embd=width, n_layer=layers, n_head=heads, n_positions=context, **common),
        "llama": lambda: LlamaConfig(num_key_value_heads=max(1, heads // 2), **llama_like),
        "qwen2": lambda: Qwen2Config(num_key_value_heads=max(1, heads // 2), **llama_like),
        "mistral": lambda: MistralConfig(num_key_value_heads=heads, sliding_window=None, **llama_like),
        "gemma3": lambda: Gemma3TextConfig(  # sliding-window layers (window 8), then a full one; capped logits
            head_dim=width // heads,
            num_key_value_heads=1,
            sliding_window=8,
            layer_types=["sliding_attention"] * (layers - 1) + ["full_attention"],
            final_logit_softcapping=30.0,
            tie_word_embeddings=False,  # tied, the embedding scale makes a random model repeat its last token
            **llama_like,
        ),
        "gpt_neox": lambda: GPTNeoXConfig(rotary_pct=0.5, **llama_like),
        "opt": lambda: OPTConfig(
            hidden_size=width,
            ffn_dim=2 * width,
            num_hidden_layers=layers,
            num_attention_heads=heads,
            max_position_embeddings=context,
            word_embed_proj_dim=width,
            **common,
        ),
        "phi": lambda: PhiConfig(partial_rotary_factor=0.5, **llama_like),
        "marian": lambda: MarianConfig(**bart_like),
        "bart": lambda: BartConfig(**bart_like),
        "t5": lambda: T5Config(
            d_model=width, d_kv=width // heads, d_ff=2 * width, num_layers=layers, num_heads=heads, **seq2seq
        ),
    }
    if arch not in builders:
        raise ValueError(f"unknown toy architecture {arch!r}: choose one of {', '.join(builders)}")
    return builders[arch]()


TOY_ARCHITECTURES = ("gpt2", "llama", "qwen2", "mistral", "gpt_neox", "opt", "phi", "gemma3")
TOY_SEQ2SEQ = ("marian", "bart", "t5")


def toy_model(arch: str = "llama", seed: int = 0, std: float | None = None, **size) -> PreTrainedModel:
    """A random-weight causal LM (or, for TOY_SEQ2SEQ, encoder-decoder) in eval mode; 2-D weights
    ~ N(0, std) for varied greedy text (std 0.2; 0.5 for T5, whose unscaled attention repeats one
    token at 0.2)."""
    std = std if std is not None else 0.5 if arch == "t5" else 0.2
    torch.manual_seed(seed)
    config = toy_config(arch, **size)
    config._attn_implementation = "eager" if arch == "opt" else "sdpa"
    model = (AutoModelForSeq2SeqLM if arch in TOY_SEQ2SEQ else AutoModelForCausalLM).from_config(config)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2 and p.requires_grad:  # frozen ones (Marian's sinusoidal positions) are fixed tables
                p.normal_(0.0, std)
    return model.eval()
