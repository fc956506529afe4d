"""Variants of the tiny test model, built locally: an EAGLE draft for it (speculative decoding
on Model Runner V2), a tiny Qwen3-MoE and a tiny hybrid Qwen3-Next with its tokenizer (model
families vLLM 0.26 runs on its V1 runner), and a tiny Qwen2-VL with an image processor (a
vision-language model, on Model Runner V2).

vLLM 0.26 loads an EAGLE-1 draft as ``EagleLlamaForCausalLM`` (``llama_eagle.py``): its
``config.json`` is a plain Llama config (``EAGLEConfig`` renames the architecture when
``method="eagle"``), and its weights are only the draft's own, named without the ``model.``
prefix (vLLM's ``load_weights`` adds it): ``fc`` over ``cat(embed(token), target hidden)`` and one
decoder layer without ``input_layernorm`` (vLLM's layer 0 skips it) and no final norm. Without
``embed_tokens`` / ``lm_head`` in the file, vLLM shares the target's.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path


def build_tiny_eagle_draft(target_dir: str | Path, out_dir: str | Path) -> Path:
    """Write (or reuse) an EAGLE draft of ``target_dir`` in ``out_dir``; returns the directory.

    The draft proposes the token it was fed again: ``fc = [I | 0]`` and zero ``o_proj`` /
    ``down_proj`` make its hidden state that token's embedding, which the target's tied
    ``lm_head`` scores highest. The tiny random target mostly repeats its last token too, so at
    a low temperature the drafts are accepted and at a high one many are rejected (recovered
    tokens drawn at draft positions).
    """
    import torch
    from safetensors.torch import save_file

    out = Path(out_dir)
    if (out / "model.safetensors").exists():
        return out
    target = json.loads((Path(target_dir) / "config.json").read_text())
    hidden, inter = target["hidden_size"], target["intermediate_size"]
    heads, kv_heads = target["num_attention_heads"], target["num_key_value_heads"]
    head_dim = target.get("head_dim") or hidden // heads
    rope = target.get("rope_parameters") or {"rope_type": "default",
                                            "rope_theta": target.get("rope_theta", 10000.0)}
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "hidden_size": hidden, "intermediate_size": inter, "num_hidden_layers": 1,
        "num_attention_heads": heads, "num_key_value_heads": kv_heads, "head_dim": head_dim,
        "hidden_act": "silu", "rms_norm_eps": target.get("rms_norm_eps", 1e-6),
        "max_position_embeddings": target["max_position_embeddings"],
        "rope_parameters": rope, "rope_theta": rope.get("rope_theta", 10000.0),
        "vocab_size": target["vocab_size"], "tie_word_embeddings": False,
        "attention_bias": False, "mlp_bias": False, "torch_dtype": "float32",
        **{key: target.get(key) for key in ("bos_token_id", "eos_token_id", "pad_token_id")},
    }
    generator = torch.Generator().manual_seed(0)

    def small_random(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator) * 0.02

    weights = {
        "fc.weight": torch.cat([torch.eye(hidden), torch.zeros(hidden, hidden)], dim=1),
        "layers.0.self_attn.q_proj.weight": small_random(heads * head_dim, hidden),
        "layers.0.self_attn.k_proj.weight": small_random(kv_heads * head_dim, hidden),
        "layers.0.self_attn.v_proj.weight": small_random(kv_heads * head_dim, hidden),
        "layers.0.self_attn.o_proj.weight": torch.zeros(hidden, heads * head_dim),
        "layers.0.mlp.gate_proj.weight": small_random(inter, hidden),
        "layers.0.mlp.up_proj.weight": small_random(inter, hidden),
        "layers.0.mlp.down_proj.weight": torch.zeros(hidden, inter),
        "layers.0.post_attention_layernorm.weight": torch.ones(hidden),
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    save_file({name: w.float().contiguous() for name, w in weights.items()},
              str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def copy_tokenizer(target_dir: str | Path, out: Path) -> None:
    """Copy ``target_dir``'s tokenizer files and chat template into ``out`` (last: a builder's
    done marker is ``tokenizer.json``)."""
    for path in Path(target_dir).iterdir():
        if "token" in path.name or path.suffix == ".jinja":
            shutil.copy(path, out / path.name)


def build_tiny_moe(target_dir: str | Path, out_dir: str | Path, hidden_size: int = 64,
                   head_dim: int = 32) -> Path:
    """Write (or reuse) a random-weight Qwen3-MoE (2 layers, 8 experts, top-2) with
    ``target_dir``'s vocabulary and tokenizer in ``out_dir``; returns the directory.
    ``hidden_size`` and ``head_dim`` set the widths: small by default (CPU), larger on the
    GPU (vLLM's fused-MoE kernels tile the expert widths; FlashAttention wants head_dim >= 64)."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    out = Path(out_dir)
    if (out / "tokenizer.json").exists():  # copied last
        return out
    target = json.loads((Path(target_dir) / "config.json").read_text())
    config = Qwen3MoeConfig(
        vocab_size=target["vocab_size"], hidden_size=hidden_size,
        intermediate_size=2 * hidden_size, moe_intermediate_size=hidden_size // 2,
        num_hidden_layers=2, num_attention_heads=hidden_size // head_dim, num_key_value_heads=1,
        head_dim=head_dim, num_experts=8, num_experts_per_tok=2,
        decoder_sparse_step=1, max_position_embeddings=4096, tie_word_embeddings=True,
        **{key: target.get(key) for key in ("bos_token_id", "eos_token_id", "pad_token_id")})
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(out)
    copy_tokenizer(target_dir, out)
    return out


def build_tiny_hybrid(target_dir: str | Path, out_dir: str | Path, hidden_size: int = 64,
                      head_dim: int = 32) -> Path:
    """Write (or reuse) a random-weight Qwen3-Next (three Gated DeltaNet layers, then one
    attention layer; 8 experts, top-2) with ``target_dir``'s vocabulary and tokenizer in
    ``out_dir``, in bfloat16; returns the directory. ``hidden_size`` and ``head_dim`` (of the
    attention and the Gated DeltaNet heads) as for ``build_tiny_moe``: larger on the GPU.

    vLLM 0.26's CPU Gated DeltaNet kernels need head widths that are multiples of 32 and a
    bfloat16 model (their float32 path fails). The embeddings are not tied: with a tied
    checkpoint every logit came out equal in vLLM (its ``lm_head`` apparently left unloaded),
    though not in transformers. The gated norm's weight starts at one and the zero-centred
    norms' at small random values, so the random model's logits differ from token to token.
    """
    import torch
    from transformers import AutoModelForCausalLM, Qwen3NextConfig

    out = Path(out_dir)
    if (out / "tokenizer.json").exists():  # copied last
        return out
    target = json.loads((Path(target_dir) / "config.json").read_text())
    config = Qwen3NextConfig(
        vocab_size=target["vocab_size"], hidden_size=hidden_size,
        intermediate_size=2 * hidden_size, num_hidden_layers=4,
        num_attention_heads=2 * hidden_size // 64, num_key_value_heads=1, head_dim=head_dim,
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=head_dim,
        linear_value_head_dim=head_dim, linear_conv_kernel_dim=4, num_experts=8,
        num_experts_per_tok=2, moe_intermediate_size=hidden_size // 2,
        shared_expert_intermediate_size=hidden_size // 2, decoder_sparse_step=1,
        layer_types=["linear_attention"] * 3 + ["full_attention"],
        max_position_embeddings=4096, tie_word_embeddings=False,
        **{key: target.get(key) for key in ("bos_token_id", "eos_token_id", "pad_token_id")})
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith("linear_attn.norm.weight"):
                parameter.fill_(1.0)
            elif name.endswith("norm.weight"):
                parameter.normal_(0.0, 0.1)
    model.to(torch.bfloat16).save_pretrained(out)
    copy_tokenizer(target_dir, out)
    return out


VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
"""Qwen2-VL's vision special tokens; a prompt shows an image as
``<|vision_start|><|image_pad|><|vision_end|>`` (vLLM expands the pad to the image's patches)."""


def build_tiny_vl(target_dir: str | Path, out_dir: str | Path) -> Path:
    """Write (or reuse) a random-weight Qwen2-VL (a one-block vision tower, 2 text layers) with
    ``target_dir``'s vocabulary and tokenizer plus ``VISION_TOKENS``, an image processor for
    56x56 to 112x112-pixel images, in ``out_dir``; returns the directory. A dense model: vLLM 0.26
    runs it on Model Runner V2."""
    import torch
    from transformers import (
        AutoModelForImageTextToText,
        PreTrainedTokenizerFast,
        Qwen2VLConfig,
        Qwen2VLImageProcessor,
        Qwen2VLProcessor,
        Qwen2VLVideoProcessor,
    )

    out = Path(out_dir)
    if (out / "processor_config.json").exists():  # written last
        return out
    target = json.loads((Path(target_dir) / "config.json").read_text())
    tokenizer = PreTrainedTokenizerFast.from_pretrained(target_dir)
    tokenizer.add_special_tokens({"additional_special_tokens": list(VISION_TOKENS)})
    ids = {token: tokenizer.convert_tokens_to_ids(token) for token in VISION_TOKENS}
    if max(ids.values()) >= target["vocab_size"]:
        raise ValueError(f"{target_dir}: no room in the vocabulary for {VISION_TOKENS}")
    special = {key: target.get(key) for key in ("bos_token_id", "eos_token_id", "pad_token_id")}
    config = Qwen2VLConfig(
        text_config=dict(vocab_size=target["vocab_size"], hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                         max_position_embeddings=4096, tie_word_embeddings=True,
                         rope_scaling={"type": "mrope", "mrope_section": [4, 6, 6]}, **special),
        vision_config=dict(depth=1, embed_dim=32, num_heads=2, hidden_size=64, mlp_ratio=2,
                           patch_size=14, spatial_merge_size=2, temporal_patch_size=2),
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=True, **special)
    torch.manual_seed(0)
    AutoModelForImageTextToText.from_config(config, dtype=torch.float32).save_pretrained(out)
    pixels = dict(min_pixels=56 * 56, max_pixels=112 * 112)
    template = Path(target_dir) / "chat_template.jinja"
    Qwen2VLProcessor(image_processor=Qwen2VLImageProcessor(**pixels), tokenizer=tokenizer,
                     video_processor=Qwen2VLVideoProcessor(**pixels),
                     chat_template=template.read_text() if template.exists() else None,
                     ).save_pretrained(out)
    return out
