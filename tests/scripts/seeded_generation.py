"""A user's script, run in a fresh interpreter: seeded generation, printed as one JSON line.

It never imports vllm_sampling_mask itself (vLLM's entry points do, when the plugin is allowed).
usage: python seeded_generation.py MODEL [--mask] [--gpu-scale]
"""

from __future__ import annotations

import json
import sys


def runner_info(worker):  # runs inside the worker process (sent by collective_rpc)
    from vllm.v1.worker.gpu.model_runner import GPUModelRunner
    from vllm_sampling_mask_testing.object_layout import attributes_in_a_dict_of_their_own

    runner = worker.model_runner
    sampler = getattr(runner, "sampler", None)
    return {
        "class": f"{type(runner).__module__}.{type(runner).__qualname__}",
        "is_model_runner_v2": isinstance(runner, GPUModelRunner),
        "sampler_uses_flashinfer": getattr(sampler, "use_flashinfer", None),
        "mask_capture_attached": getattr(sampler, "sampling_mask_capture", None) is not None,
        "sampler_attributes_in_a_dict": attributes_in_a_dict_of_their_own(sampler,
                                                                          "use_flashinfer"),
    }


def plugin_targets() -> set[str]:
    from vllm_sampling_mask.patches import PATCHES

    return {patch.target for patch in PATCHES}


def main() -> None:
    model, mask = sys.argv[1], "--mask" in sys.argv
    imported_before = "vllm_sampling_mask" in sys.modules
    from vllm import LLM, SamplingParams

    kwargs = dict(enforce_eager=True, max_model_len=256, max_num_seqs=8, seed=0)
    if "--gpu-scale" not in sys.argv:
        kwargs["dtype"] = "float32"
    if mask:
        kwargs.update(return_sampling_mask=True, logprobs_mode="processed_logprobs")
    llm = LLM(model, **kwargs)
    params = [SamplingParams(temperature=1.0, top_k=20, top_p=0.9, max_tokens=8, seed=i, logprobs=3)
              for i in range(4)]
    outputs = llm.generate(["Hello world", "the quick", "kalo", "0123"], params, use_tqdm=False)
    completions = [o.outputs[0] for o in outputs]
    patching = sys.modules.get("vllm_sampling_mask.patching")
    print("RESULT " + json.dumps({
        "imported_our_package_before_vllm": imported_before,
        # the plugin's patches only (the test platform plugin installs its own in both runs)
        "applied_patches": sorted(set(patching.applied_targets()) & plugin_targets())
        if patching else [],
        "runner": llm.collective_rpc(runner_info),
        "token_ids": [list(c.token_ids) for c in completions],
        "logprobs": [[{str(k): v.logprob for k, v in d.items()} for d in c.logprobs] for c in completions],
        "sampling_mask": [getattr(c, "sampling_mask", None) and c.sampling_mask.token_ids
                          for c in completions],
    }), flush=True)


if __name__ == "__main__":
    main()
