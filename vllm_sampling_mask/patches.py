"""Every vLLM symbol this plugin patches, and why: the one list (``PATCHES``).

Written for vLLM 0.26.x (``patching.SUPPORTED_VLLM_SERIES``); all of it goes once vLLM >= 0.28
(native ``--return-sampling-mask``) is the floor. ``process`` names where the patch matters:
``frontend`` (API server / ``LLM`` process), ``engine-core`` (scheduler process), ``worker``
(model runner processes). Every process installs the whole list: each wrapper does nothing but
read its engine's switch unless the switch is on (the routers' ``JSONResponse`` looks for masks in
the body instead: only a mask server's responses carry them), the ones called once per output
and the bindings that make their objects (``scoped=True``) are not even bound unless it is, and
the client's ``EngineCoreOutputs`` type decodes one more optional (trailing, absent = None)
field on every engine. Tests check that
every entry resolves and reverts.
"""

from __future__ import annotations

from vllm_sampling_mask.patching import Patch

_P = "vllm_sampling_mask"

PATCHES: list[Patch] = [
    # --- config / CLI (frontend) ---
    Patch(
        target="vllm.engine.arg_utils:EngineArgs.__init__",
        make=f"{_P}.engine.arg_utils:wrap_init",
        why="LLM(..., return_sampling_mask=True) and EngineArgs(return_sampling_mask=True): "
        "pydantic configs forbid new fields, so the keyword folds into additional_config.",
        process="frontend",
    ),
    Patch(
        target="vllm.engine.arg_utils:AsyncEngineArgs.__init__",
        make=f"{_P}.engine.arg_utils:wrap_init",
        why="Same keyword for AsyncEngineArgs (a dataclass subclass has its own __init__).",
        process="frontend",
    ),
    Patch(
        target="vllm.engine.arg_utils:EngineArgs.add_cli_args",
        make=f"{_P}.engine.arg_utils:wrap_add_cli_args",
        why="--return-sampling-mask in `vllm serve` (AsyncEngineArgs.add_cli_args calls it).",
        process="frontend",
    ),
    Patch(
        target="vllm.engine.arg_utils:EngineArgs.from_cli_args",
        make=f"{_P}.engine.arg_utils:wrap_from_cli_args",
        why="from_cli_args keeps only dataclass fields; carry the flag into additional_config.",
        process="frontend",
    ),
    Patch(
        target="vllm.engine.arg_utils:EngineArgs.create_engine_config",
        make=f"{_P}.engine.arg_utils:wrap_create_engine_config",
        why="Engine-start checks before any model loads. The version guard: on a vLLM other "
        "than 0.26.x only this patch is installed, and refuses the switch by version.",
        process="frontend",
        version_guard=True,
    ),
    # --- per-request validation (frontend) ---
    Patch(
        target="vllm.v1.engine.input_processor:InputProcessor._validate_params",
        make=f"{_P}.engine.input_processor:wrap_validate_params",
        why="temperature > 0 and top_k > 0 per request (ValueError / HTTP 400 for that request).",
        process="frontend",
    ),
    Patch(
        target="vllm.v1.engine.input_processor:InputProcessor.process_inputs",
        make=f"{_P}.engine.input_processor:wrap_process_inputs",
        why="Refuse (HTTP 400), on a mask engine, every request whose values Model Runner V2's "
        "fixed-width per-request tensors can't hold (the worker would raise, ending the engine).",
        process="frontend",
    ),
    Patch(
        target="vllm.entrypoints.generate.beam_search.offline:BeamSearchOfflineMixin.beam_search",
        make=f"{_P}.engine.input_processor:wrap_offline_beam_search",
        why="LLM.beam_search has no sampled distribution: a clear error instead of a top_k one.",
        process="frontend",
    ),
    Patch(
        target="vllm.entrypoints.generate.beam_search.online:BeamSearchOnlineMixin.beam_search",
        make=f"{_P}.engine.input_processor:wrap_online_beam_search",
        why="The server's beam search, refused the same way.",
        process="frontend",
    ),
    # --- worker, Model Runner V2 (where vLLM picks it): capture and async copy ---
    Patch(
        target="vllm.v1.worker.gpu.model_runner:GPUModelRunner.load_model",
        make=f"{_P}.worker.sampler:wrap_load_model",
        why="Attach the capture to the MRV2 sampler (built in load_model) and turn off its "
        "FlashInfer path, which never materialises the filtered logits.",
        process="worker",
    ),
    Patch(
        target="vllm.v1.worker.gpu.sample.sampler:Sampler.add_request",
        make=f"{_P}.worker.sampler:wrap_add_request",
        why="Remember per request slot whether it wants masks (extra_args opt-out), so steps "
        "skip opted-out rows, and steps without any capture nothing.",
        process="worker",
    ),
    Patch(
        target="vllm.v1.worker.gpu.sample.sampler:Sampler.sample",
        make=f"{_P}.worker.sampler:wrap_sample",
        why="Steps sample here with the candidate sampler (the kernel that samples writes the "
        "kept ids; faster than vLLM's samplers) where every top_k <= 1024, masks wanted or "
        "not; other mask steps with vLLM's path, whose processed logits after top-k/top-p "
        "exist only here, then compacted (Triton).",
        process="worker",
    ),
    Patch(
        target="vllm.v1.worker.gpu.sample.sampler:Sampler.__call__",
        make=f"{_P}.worker.sampler:wrap_call",
        why="Hand the step's device masks to SamplerOutput (a plain dataclass).",
        process="worker",
    ),
    Patch(
        target="vllm.v1.worker.gpu.sample.sampler:compute_topk_scores",
        make=f"{_P}.worker.sampler:wrap_compute_topk_scores",
        why="A candidate step's processed logprobs come from the kernel that samples it (a "
        "log-softmax over the kept ids); Sampler.__call__ calls this by its module name: "
        "return those instead of passes over the [R, V] logits.",
        process="worker",
    ),
    Patch(
        target="vllm.v1.worker.gpu.spec_decode.rejection_sampler:RejectionSampler.__call__",
        make=f"{_P}.worker.sampler:wrap_rejection_sampler_call",
        why="Speculative decoding: a step with draft tokens is sampled here, not by Sampler: "
        "hand its masks (one row per position, grouped by request) to SamplerOutput.",
        process="worker",
    ),
    Patch(
        target="vllm.v1.worker.gpu.spec_decode.rejection_sampler:rejection_sample",
        make=f"{_P}.worker.sampler:wrap_rejection_sample",
        why="The processed logits of every position of a speculative step exist only as this "
        "function's argument (RejectionSampler.__call__ makes them and calls it by its module "
        "name): compact them (Triton).",
        process="worker",
    ),
    Patch(
        target="vllm.v1.worker.gpu.async_utils:AsyncOutput.__init__",
        make=f"{_P}.worker.async_output:wrap_init",
        why="Device->host copy of the step's masks on the main stream just before vLLM's "
        "copies, so that vLLM's own copy event covers it (none where the candidate kernel "
        "wrote them into mapped host memory: the same event covers that kernel).",
        process="worker",
    ),
    Patch(
        target="vllm.v1.worker.gpu.async_utils:AsyncOutput.get_output",
        make=f"{_P}.worker.async_output:wrap_get_output",
        why="Unpack the host copy into one int32 bytes row per request "
            "(ModelRunnerOutput.sampling_masks).",
        process="worker",
    ),
    # --- worker, V1 model runner (where vLLM picks it): capture and copy ---
    Patch(
        target="vllm.v1.worker.gpu_model_runner:GPUModelRunner.__init__",
        make=f"{_P}.worker.v1_model_runner:wrap_init",
        why="Share a capture between the V1 runner and its sampler (both built here; the CPU "
        "runner subclasses it and calls it, but has its own load_model).",
        process="worker",
    ),
    Patch(
        target="vllm.v1.worker.gpu_model_runner:GPUModelRunner._update_states",
        make=f"{_P}.worker.v1_model_runner:wrap_update_states",
        why="Track the requests that opted out (extra_args), by id: V1's input batch moves "
        "rows between slots, and a step with no opted-out request then costs nothing per row.",
        process="worker",
    ),
    Patch(
        target="vllm.v1.worker.gpu_model_runner:GPUModelRunner.sample_tokens",
        make=f"{_P}.worker.v1_model_runner:wrap_sample_tokens",
        why="Hand the sampler the step's host-side top_k and rows that want masks; after the "
        "step, copy the masks on V1's async output copy stream (or at once when scheduling "
        "is synchronous, where the step has already waited for the device).",
        process="worker",
    ),
    Patch(
        target="vllm.v1.sample.sampler:Sampler.sample",
        make=f"{_P}.worker.v1_model_runner:wrap_sampler_sample",
        why="The logits after every transform (custom logits processors included) exist only "
        "here, as the processed logprobs it returns: compact them (Triton).",
        process="worker",
    ),
    Patch(
        target="vllm.v1.sample.rejection_sampler:rejection_sample",
        make=f"{_P}.worker.v1_model_runner:wrap_rejection_sample",
        why="Speculative decoding: the draft positions' target logits after temperature, top-k "
        "and top-p exist only as this function's argument (RejectionSampler.forward makes them "
        "and calls it by its module name): compact them, one row per draft position.",
        process="worker",
    ),
    Patch(
        target="vllm.v1.worker.gpu_model_runner:AsyncGPUModelRunnerOutput.get_output",
        make=f"{_P}.worker.v1_model_runner:wrap_async_get_output",
        why="Unpack the host copy into one int32 bytes row per request "
            "(ModelRunnerOutput.sampling_masks), as for MRV2.",
        process="worker",
    ),
    # --- engine core: per-request slicing and transport ---
    Patch(
        target="vllm.v1.core.sched.scheduler:Scheduler.__init__",
        make=f"{_P}.core.scheduler:wrap_init",
        why="Remember the engine's switch (read once, not per step).",
        process="engine-core",
    ),
    Patch(
        target="vllm.v1.core.sched.scheduler:Scheduler.add_request",
        make=f"{_P}.core.scheduler:wrap_add_request",
        why="A FINAL_ONLY request's rows are held until its last output: its entry in the "
        "scheduler's table of held rows.",
        process="engine-core",
    ),
    Patch(
        target="vllm.v1.core.sched.scheduler:Scheduler.update_from_output",
        make=f"{_P}.core.scheduler:wrap_update_from_output",
        why="Cut the batch's rows per request by the final, trimmed number of new tokens.",
        process="engine-core",
    ),
    Patch(
        target="vllm.v1.core.sched.scheduler:EngineCoreOutput",
        make=f"{_P}.engine.transport:replace_engine_core_output",
        why="Inside update_from_output of a mask engine, outputs are built as our msgspec "
        "subclass with a trailing sampling_mask field. Scoped: elsewhere the binding is vLLM's "
        "class (same bytes, and no per-output cost with the switch off).",
        process="engine-core",
        scoped=True,
    ),
    Patch(
        target="vllm.v1.engine.core_client:EngineCoreOutputs",
        make=f"{_P}.engine.transport:replace_engine_core_outputs",
        why="The client's MsgpackDecoder is typed with this binding; typed with vLLM's class it "
        "would silently drop the mask field.",
        process="frontend",
    ),
    # --- frontend: accumulation and user-facing output ---
    Patch(
        target="vllm.v1.engine.llm_engine:LLMEngine.__init__",
        make=f"{_P}.engine.transport:wrap_engine_init",
        why="Engine-start checks also for engines built from a VllmConfig (not EngineArgs); "
        "check the decoder keeps masks; switch the output processor on.",
        process="frontend",
    ),
    Patch(
        target="vllm.v1.engine.async_llm:AsyncLLM.__init__",
        make=f"{_P}.engine.transport:wrap_engine_init",
        why="Same for the server's engine client.",
        process="frontend",
    ),
    Patch(
        target="vllm.v1.engine.output_processor:OutputProcessor.add_request",
        make=f"{_P}.engine.output_processor:wrap_add_request",
        why="Every request of a mask engine that wants masks gets a row list (empty masks for "
            "0-token outputs).",
        process="frontend",
    ),
    Patch(
        target="vllm.v1.engine.output_processor:OutputProcessor.process_outputs",
        make=f"{_P}.engine.output_processor:wrap_process_outputs",
        why="Append each step's rows to the request state before outputs are built.",
        process="frontend",
    ),
    Patch(
        target="vllm.v1.engine.output_processor:RequestState._new_completion_output",
        make=f"{_P}.engine.output_processor:wrap_new_completion_output",
        why="Attach SamplingMask aligned with token_ids (all rows, or the delta's rows). Scoped: "
        "bound on the request states of a mask engine only (called per output).",
        process="frontend",
        scoped=True,
    ),
    Patch(
        target="vllm.v1.engine.output_processor:RequestState",
        make=f"{_P}.engine.output_processor:mask_request_state",
        why="A mask request's state is made as the subclass with the method above (scoped: "
        "bound inside that request's add_request only), not moved into it afterwards: on "
        "CPython 3.11-3.12 a class change slows every attribute read of the state.",
        process="frontend",
        scoped=True,
    ),
    Patch(
        target="vllm.outputs:RequestOutput.add",
        make=f"{_P}.engine.output_processor:wrap_request_output_add",
        why="Coalesced streaming deltas merge masks (vLLM copies only text/tokens/logprobs).",
        process="frontend",
    ),
    Patch(
        target="vllm.outputs:CompletionOutput.sampling_mask",
        make=f"{_P}.engine.output_processor:add_completion_output_field",
        why="CompletionOutput.sampling_mask reads None where no mask was attached (flag off).",
        process="frontend",
        adds=True,
    ),
    Patch(
        target="vllm.outputs:SamplingMask",
        make=f"{_P}.engine.output_processor:export_sampling_mask_type",
        why="`from vllm.outputs import SamplingMask`, as in vLLM >= 0.28.",
        process="frontend",
        adds=True,
    ),
    Patch(
        target="vllm:sampling_mask",
        make=f"{_P}.outputs:make_upstream_module",
        why="`from vllm.sampling_mask import SamplingMask`, upstream's module (vLLM >= 0.28): "
        "a module object in sys.modules, installed while `import vllm` runs (platform plugin), "
        "nothing written into vLLM's package.",
        process="frontend",
        adds=True,
        new_module=True,
    ),
    # --- entrypoints (HTTP) ---
    Patch(
        target="vllm.entrypoints.serve.utils.api_utils:validate_json_request",
        make=f"{_P}.entrypoints.api_utils:wrap_validate_json_request",
        why="A valid JSON body that is not an object makes vLLM's request models raise "
        "AttributeError (HTTP 500): on a mask server the routes' JSON dependency answers 400. "
        "Installed when api_utils is imported, before the routers bind it in Depends().",
        process="frontend",
    ),
    Patch(
        target="vllm.entrypoints.scale_out.token_in_token_out.serving:ServingTokens.serve_tokens",
        make=f"{_P}.entrypoints.token_in_token_out:wrap_serve_tokens",
        why="/inference/v1/generate: read and validate the mask fields (GenerateRequest drops "
        "unknown fields, so from the cached JSON body); HTTP 400 on a bad one. A non-streamed "
        "request with masks asks for its final output only (FINAL_ONLY for CUMULATIVE).",
        process="frontend",
    ),
    Patch(
        target="vllm.entrypoints.scale_out.token_in_token_out.serving:"
        "ServingTokens.serve_tokens_full_generator",
        make=f"{_P}.entrypoints.token_in_token_out:wrap_serve_tokens_full_generator",
        why="Rebuild the response as GenerateResponseWithMasks: pydantic serialises choices by "
        "the declared type, so the choice subclass with sampling_mask must be declared.",
        process="frontend",
    ),
    Patch(
        target="vllm.entrypoints.scale_out.token_in_token_out.serving:"
        "ServingTokens.serve_tokens_stream_generator",
        make=f"{_P}.entrypoints.sse:wrap_request_output_stream",
        why="Every streamed chunk carries the rows of its tokens (engine outputs observed on "
        "the way in, SSE chunks rewritten on the way out).",
        process="frontend",
    ),
    Patch(
        target="vllm.entrypoints.openai.completion.serving:OpenAIServingCompletion.create_completion",
        make=f"{_P}.entrypoints.completion:wrap_create_completion",
        why="/v1/completions opt-in fields (return_sampling_mask, sampling_mask_format): "
        "validated here (HTTP 400); other requests go straight to vLLM.",
        process="frontend",
    ),
    Patch(
        target="vllm.entrypoints.openai.completion.serving:"
        "OpenAIServingCompletion.request_output_to_completion_response",
        make=f"{_P}.entrypoints.completion:wrap_request_output_to_completion_response",
        why="Non-streaming /v1/completions: token_ids and sampling_mask on each choice.",
        process="frontend",
    ),
    Patch(
        target="vllm.entrypoints.openai.completion.serving:"
        "OpenAIServingCompletion.completion_stream_generator",
        make=f"{_P}.entrypoints.completion:wrap_completion_stream_generator",
        why="Streaming /v1/completions: every chunk carries the rows of its tokens.",
        process="frontend",
    ),
    Patch(
        target="vllm.entrypoints.openai.chat_completion.serving:OpenAIServingChat.create_chat_completion",
        make=f"{_P}.entrypoints.chat_completion:wrap_create_chat_completion",
        why="/v1/chat/completions opt-in fields, validated here (HTTP 400).",
        process="frontend",
    ),
    Patch(
        target="vllm.entrypoints.openai.chat_completion.serving:"
        "OpenAIServingChat.chat_completion_full_generator",
        make=f"{_P}.entrypoints.chat_completion:wrap_chat_completion_full_generator",
        why="Non-streaming /v1/chat/completions: token_ids and sampling_mask on each choice.",
        process="frontend",
    ),
    Patch(
        target="vllm.entrypoints.openai.chat_completion.serving:"
        "OpenAIServingChat.chat_completion_stream_generator",
        make=f"{_P}.entrypoints.sse:wrap_request_output_stream",
        why="Streaming /v1/chat/completions: every chunk carries the rows of its tokens "
        "(tokens a parser holds back ride in the choice's next chunk).",
        process="frontend",
    ),
    Patch(
        target="vllm.entrypoints.scale_out.token_in_token_out.api_router:JSONResponse",
        make=f"{_P}.entrypoints.json_response:mask_json_response",
        why="A non-streamed /inference/v1/generate body with masks (tens of KB) is written by "
        "msgspec, ~10x faster than json.dumps: the API server builds the responses of requests "
        "that finish together one after the other. Other bodies are Starlette's.",
        process="frontend",
    ),
    Patch(
        target="vllm.entrypoints.openai.completion.api_router:JSONResponse",
        make=f"{_P}.entrypoints.json_response:mask_json_response",
        why="The same for /v1/completions.",
        process="frontend",
    ),
    Patch(
        target="vllm.entrypoints.openai.chat_completion.api_router:JSONResponse",
        make=f"{_P}.entrypoints.json_response:mask_json_response",
        why="The same for /v1/chat/completions.",
        process="frontend",
    ),
    Patch(
        target="vllm.entrypoints.openai.api_server:init_app_state",
        make=f"{_P}.entrypoints.api_server:wrap_init_app_state",
        why="/metrics gauges vllm_sampling_mask:held_requests / held_rows (mask state of "
        "in-flight requests; 0 once none is in flight). run_batch's own binding is left alone: "
        "it serves no /metrics.",
        process="frontend",
    ),
]
