"""The optional C extension; everything else is in pyproject.toml.

``vllm_sampling_mask.core._hand_out_native`` is the engine core's per-output row hand-out
without the interpreter. It is optional: where no C compiler or no Python headers are found the
install goes on without it, and the scheduler runs the same loop in Python.
"""

from setuptools import Extension, setup

setup(ext_modules=[Extension("vllm_sampling_mask.core._hand_out_native",
                             ["vllm_sampling_mask/core/_hand_out_native.c"], optional=True)])
