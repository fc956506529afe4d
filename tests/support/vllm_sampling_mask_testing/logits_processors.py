"""A custom vLLM (V1) logits processor for tests: ``--logits-processors`` with sampling masks.

``BanEvenTokenIds`` sets every even token id's logit to -inf for the requests that ask for it
(``SamplingParams.extra_args["ban_even_token_ids"] = True``) and leaves the others alone. It may
change the argmax, so vLLM applies it before penalties, temperature and top-k/top-p: a mask row
of such a request must hold odd ids only.
"""

from __future__ import annotations

from typing import Any

import torch

from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor, MoveDirectionality

REQUEST_KEY = "ban_even_token_ids"
PROCESSOR = "vllm_sampling_mask_testing.logits_processors:BanEvenTokenIds"
"""The ``--logits-processors`` / ``LLM(logits_processors=[...])`` name of the processor."""


class BanEvenTokenIds(LogitsProcessor):
    """Bans even token ids for the batch rows whose request set ``extra_args[REQUEST_KEY]``."""

    def __init__(self, vllm_config: Any, device: torch.device, is_pin_memory: bool) -> None:
        self.rows: set[int] = set()  # persistent-batch indices of the requests that ask

    def is_argmax_invariant(self) -> bool:
        return False

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        if batch_update is None:
            return
        for index in batch_update.removed:
            self.rows.discard(index)
        for index, params, _, _ in batch_update.added:
            if (params.extra_args or {}).get(REQUEST_KEY):
                self.rows.add(index)
            else:
                self.rows.discard(index)
        for source, target, direction in batch_update.moved:
            source_asks, target_asks = source in self.rows, target in self.rows
            self.rows.discard(source)
            self.rows.discard(target)
            if source_asks:
                self.rows.add(target)
            if direction == MoveDirectionality.SWAP and target_asks:
                self.rows.add(source)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """``logits`` ``[R, V]``, changed in place."""
        if not self.rows:
            return logits
        asks = torch.zeros(logits.shape[0], dtype=torch.bool)
        asks[sorted(r for r in self.rows if r < logits.shape[0])] = True
        logits[:, 0::2].masked_fill_(asks.to(logits.device).unsqueeze(1), float("-inf"))
        return logits
