"""A tiny random-weight Qwen2 model plus a locally trained byte-level BPE tokenizer.

Nothing is downloaded: the tokenizer is trained on generated text and the weights are random
(seeded), so tests and the demo run on a fresh machine with no model hub. Building takes a few
seconds; the result (~2 MB) is cached in the given directory.
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
_DONE = "tiny_model.json"


def _corpus(seed: int) -> list[str]:
    rng = random.Random(seed)
    syllables = ["ka", "lo", "mi", "tor", "en", "qu", "ra", "zen", "st", "ph", "ing", "the", "and"]
    words = ["".join(rng.choice(syllables) for _ in range(rng.randint(1, 3))) for _ in range(1500)]
    lines = [" ".join(rng.choice(words) for _ in range(rng.randint(4, 30))) for _ in range(6000)]
    return lines + ["Hello world! The quick brown fox jumps over the lazy dog. 0123456789"] * 20


def build_tiny_model(out_dir: str | os.PathLike[str], *, tokenizer_vocab: int = 2048,
                     model_vocab: int = 4096, seed: int = 0) -> Path:
    """Build (or reuse) the model in ``out_dir``; returns the directory.

    ``model_vocab`` > ``tokenizer_vocab`` gives realistic logits widths (ids the tokenizer never
    produces still get logits, as in real checkpoints whose embeddings are padded).
    """
    out = Path(out_dir)
    spec = {"tokenizer_vocab": tokenizer_vocab, "model_vocab": model_vocab, "seed": seed}
    marker = out / _DONE
    if marker.exists() and json.loads(marker.read_text()) == spec:
        return out

    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast, Qwen2Config

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=tokenizer_vocab, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tokenizer.train_from_iterator(_corpus(seed), trainer=trainer)
    hf_tokenizer = PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|endoftext|>",
                                           pad_token="<|endoftext|>")
    hf_tokenizer.chat_template = CHAT_TEMPLATE
    eos_id = hf_tokenizer.convert_tokens_to_ids("<|endoftext|>")

    config = Qwen2Config(
        vocab_size=model_vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=32, max_position_embeddings=2048,
        tie_word_embeddings=True, bos_token_id=eos_id, eos_token_id=eos_id, pad_token_id=eos_id,
    )
    config.architectures = ["Qwen2ForCausalLM"]
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    # Random init gives near-uniform logits; a wider embedding scale gives peaked, more
    # realistic distributions (so top-p / min-p actually cut).
    with torch.no_grad():
        model.get_input_embeddings().weight.mul_(6.0)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    hf_tokenizer.save_pretrained(out)
    marker.write_text(json.dumps(spec))
    return out
