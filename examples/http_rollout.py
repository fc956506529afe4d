"""Roll out through `vllm serve` and the OpenAI client (compact masks), then one GRPO step.

    python examples/http_rollout.py                       # builds a tiny model, serves it
    python examples/http_rollout.py MODEL_DIR             # serves MODEL_DIR
    python examples/http_rollout.py MODEL_DIR --url http://127.0.0.1:8000
        # a server you started: vllm serve MODEL_DIR --return-sampling-mask \\
        #     --logprobs-mode processed_logprobs

1. Without ``--url`` it starts ``vllm serve MODEL --return-sampling-mask --logprobs-mode
   processed_logprobs`` on a free local port and stops it at the end.
2. ``/v1/completions`` through the OpenAI Python client; the non-OpenAI fields go in
   ``extra_body``: ``top_k``, ``return_sampling_mask``, ``sampling_mask_format: "compact"``
   (each choice's ``sampling_mask`` is then a base64 CSR dict, ~2.3x smaller than JSON lists)
   and ``return_token_ids`` (the prompt's and completion's token ids, for the trainer).
3. ``grpo_step.py`` scores the completions with MODEL as a transformers policy, on the kept sets
   (the compact dicts go to ``support_logprobs`` as they are), and takes one clipped GRPO step.

Exits 1 like ``rollout_and_score.py``.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator

import torch
from openai import OpenAI

from grpo_step import Rollout, add_rollout_args, grpo_step, report

PROMPTS = ["The quick brown fox", "Hello world"]


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_rollout_args(parser, "server")
    parser.add_argument("--url", help="a running server started with --return-sampling-mask "
                                      "(default: start one)")
    parser.add_argument("--start-timeout", type=float, default=600.0)
    return parser.parse_args()


@contextlib.contextmanager
def vllm_serve(model: str, dtype: str, max_num_seqs: int, timeout: float) -> Iterator[str]:
    """``vllm serve`` with masks on, on a free local port; yields its URL once healthy."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    command = [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", model,
               "--return-sampling-mask", "--logprobs-mode", "processed_logprobs",
               "--dtype", dtype, "--enforce-eager", "--max-model-len", "1024",
               "--max-num-seqs", str(max_num_seqs), "--gpu-memory-utilization", "0.4",
               "--generation-config", "vllm", "--host", "127.0.0.1", "--port", str(port)]
    print(" ".join(command), flush=True)
    server = subprocess.Popen(command, start_new_session=True)  # its own process group
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout
        while not _healthy(url):
            if server.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"vllm serve did not come up (exit status {server.poll()})")
            time.sleep(1)
        yield url
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()


def _healthy(url: str) -> bool:
    with contextlib.suppress(OSError):
        with urllib.request.urlopen(f"{url}/health", timeout=5) as response:
            return response.status == 200
    return False


def roll_out(url: str, args: argparse.Namespace) -> list[Rollout]:
    client = OpenAI(base_url=f"{url}/v1", api_key="EMPTY")
    served_model = client.models.list().data[0].id
    response = client.completions.create(
        model=served_model, prompt=PROMPTS, n=args.group_size, max_tokens=args.max_tokens,
        temperature=args.temperature, top_p=args.top_p, logprobs=0,
        extra_body={"top_k": args.top_k, "return_sampling_mask": True,
                    "sampling_mask_format": "compact", "return_token_ids": True},
    )
    # Choices come n per prompt, prompt after prompt (index = prompt * n + sample).
    return [
        Rollout(prompt_token_ids=choice.prompt_token_ids, token_ids=choice.token_ids,
                logprobs=choice.logprobs.token_logprobs,
                sampling_mask=choice.sampling_mask)  # {"encoding": "csr-delta-varint-base64", ...}
        for choice in sorted(response.choices, key=lambda c: c.index)
    ]


def main() -> int:
    args = parse_args()
    if args.model is None:
        from vllm_sampling_mask.demo import DEFAULT_MODEL_DIR
        from vllm_sampling_mask.tiny_model import build_tiny_model

        args.model = str(build_tiny_model(DEFAULT_MODEL_DIR))
    if args.url:
        rollouts = roll_out(args.url.rstrip("/"), args)
    else:
        max_num_seqs = len(PROMPTS) * args.group_size
        with vllm_serve(args.model, args.dtype, max_num_seqs, args.start_timeout) as url:
            rollouts = roll_out(url, args)

    from transformers import AutoModelForCausalLM

    device = "cuda" if torch.cuda.is_available() else "cpu"
    policy = AutoModelForCausalLM.from_pretrained(args.model, dtype=getattr(torch, args.dtype))
    policy.to(device).train()
    optimizer = torch.optim.SGD(policy.parameters(), lr=1e-3)
    metrics = grpo_step(policy, optimizer, rollouts, args.group_size, args.temperature)
    return report(metrics, args.max_ratio_error)


if __name__ == "__main__":
    sys.exit(main())
