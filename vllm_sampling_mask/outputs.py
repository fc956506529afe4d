"""User-facing output type (also exported as ``vllm.outputs.SamplingMask``). No vLLM import."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SamplingMask:
    """The kept support of every generated token of one completion.

    ``token_ids[i]`` lists, in ascending order, the vocabulary ids whose processed logit was
    finite when ``CompletionOutput.token_ids[i]`` was sampled (after logit bias, penalties, bad
    words, temperature, min-p and top-k/top-p). The sampled token is always in its row.
    """

    token_ids: list[list[int]] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.token_ids)
