"""Trainer side of sampling masks: pi_theta's log-prob renormalised over each token's kept set.

Needs torch and numpy only; importing it never imports vLLM, Triton or transformers (the replay
audit, ``python -m vllm_sampling_mask.training.audit``, imports those inside its functions).

    masks = PackedMasks.from_any(completion.sampling_mask)       # or .from_compact(http_dict)
    logprobs = support_logprobs(logits, token_ids, masks)        # [T] float32, differentiable
"""

from vllm_sampling_mask.training._rows import IGNORE_INDEX
from vllm_sampling_mask.training.logprobs import support_logprobs, support_logprobs_reference
from vllm_sampling_mask.training.logprobs_from_hidden import support_logprobs_from_hidden
from vllm_sampling_mask.training.metrics import importance_ratio_metrics, kept_probability_mass
from vllm_sampling_mask.training.packed import PackedMasks, pack_padded_batch

__all__ = [
    "IGNORE_INDEX",
    "PackedMasks",
    "importance_ratio_metrics",
    "kept_probability_mass",
    "pack_padded_batch",
    "support_logprobs",
    "support_logprobs_from_hidden",
    "support_logprobs_reference",
]
