"""Tiny random models of each supported family, built in code (no download): tests and demos.

It owns the tiny configs (``tiny_hf_config``), a deterministic byte-level BPE tokenizer with ChatML
specials (``tiny_tokenizer``), the seeded HF models, and ``tiny_models`` which returns a specroll
``Decoder`` and the transformers model holding the *same* weights, so a test can compare the two.

The tiny models use ``initializer_range=0.2`` (HF's default is 0.02) so that their next-token
distributions are peaked rather than uniform: greedy decoding has no near-ties and a wrong
verification rule moves a sampled distribution visibly.
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch

TINY_VOCAB = 320
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # ids 0, 1, 2
ARCHS = ("llama", "qwen2", "qwen3")
CHATML_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
_CORPUS = [
    "You are a helpful assistant. Answer the question and put the final answer in \\boxed{}.",
    "What is 12 + 34? Let me think step by step. 12 + 34 = 46. The answer is \\boxed{46}.",
    "Compute 7 * 8 - 5. First, 7 * 8 = 56. Then 56 - 5 = 51. So the answer is 51.",
    "system user assistant the of and to in is that for with on as by this are from",
    "#### 128 <think> </think> therefore equals plus minus times divided number",
]


@functools.lru_cache(maxsize=1)
def _tokenizer_json() -> str:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=TINY_VOCAB, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_CORPUS * 4, trainer)
    return tok.to_str()


def tiny_tokenizer():
    """Byte-level BPE: 3 ChatML specials (ids 0-2), 256 bytes, merges up to ``TINY_VOCAB``; eos = <|im_end|>."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    fast = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(_tokenizer_json()), bos_token="<|im_start|>",
                                   eos_token="<|im_end|>", pad_token="<|endoftext|>", unk_token="<|endoftext|>")
    fast.chat_template = CHATML_TEMPLATE
    return fast


def tiny_hf_config(arch: str, **overrides):
    """A small transformers config of the family ``arch`` ("llama" | "qwen2" | "qwen3").

    Defaults: vocab 320, hidden 64, 2 layers, 4 heads of 16, 2 KV heads, intermediate 128; Llama ties
    its embeddings, Qwen2 has qkv bias, Qwen3 has q/k norm. ``overrides`` go to the config class, e.g.
    ``rope_parameters={"rope_type": "llama3", ...}``.
    """
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config

    classes = {"llama": LlamaConfig, "qwen2": Qwen2Config, "qwen3": Qwen3Config}
    if arch not in classes:
        raise ValueError(f"unknown tiny architecture {arch!r}; choose one of {', '.join(classes)}")
    kw = dict(vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=2048,
              rms_norm_eps=1e-6, tie_word_embeddings=arch == "llama", initializer_range=0.2,
              bos_token_id=1, eos_token_id=2, pad_token_id=0)
    kw.update(overrides)
    return classes[arch](**kw)


def tiny_hf_model(arch: str, seed: int = 0, **overrides):
    """A seeded random transformers model from ``tiny_hf_config`` (the global RNG state is untouched)."""
    from transformers import AutoModelForCausalLM

    cfg = tiny_hf_config(arch, **overrides)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    return model.eval()


def decoder_from_hf(hf_model, dtype: torch.dtype = torch.float32):
    """A specroll ``Decoder`` holding a copy of ``hf_model``'s weights."""
    from .decoder import Decoder, DecoderConfig, hf_to_decoder_state

    cfg = DecoderConfig.from_hf(hf_model.config)
    model = Decoder(cfg)
    sd = {k: v.detach().clone() for k, v in hf_model.state_dict().items()}
    model.load_state_dict(hf_to_decoder_state(sd, cfg), strict=not cfg.tie_embeddings)
    return model.to(dtype).eval()


def tiny_models(arch: str, seed: int = 0, **overrides):
    """(Decoder, tokenizer, hf_model) of one tiny family, the decoder and HF model with equal weights."""
    hf = tiny_hf_model(arch, seed, **overrides)
    return decoder_from_hf(hf), tiny_tokenizer(), hf


def build_tiny(arch: str, out: Path, seed: int = 0) -> None:
    """Write the seeded tiny model + tokenizer of ``arch`` as an HF directory (no completion marker)."""
    tok = tiny_tokenizer()
    model = tiny_hf_model(arch, seed)
    if len(tok) > model.config.vocab_size:
        raise ValueError(f"the tiny tokenizer has {len(tok)} tokens but the config only {model.config.vocab_size}")
    model.save_pretrained(str(out), safe_serialization=True)
    tok.save_pretrained(str(out))
