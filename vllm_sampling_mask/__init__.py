"""vllm-sampling-mask: per-token sampling masks (the kept top-k/top-p/min-p support) for vLLM 0.26.

Importing this package does not import vLLM: the trainer side (``vllm_sampling_mask.training``)
and the compact wire format work with numpy/torch alone. vLLM loads the engine side itself
through the package's entry points.
"""

__version__ = "0.1.0"
