"""The optional C extensions; everything else is in pyproject.toml.

Two per-output loops without the interpreter: the engine core's row hand-out
(``core/_hand_out_native.c``) and the frontend's row intake (``engine/_take_rows_native.c``).
Both read their objects' fields through ``_slot_fields.h``. Both are optional: where no C
compiler or no Python headers are found the install goes on without them, and the same loops
run in Python.
"""

from setuptools import Extension, setup

setup(ext_modules=[
    Extension(f"vllm_sampling_mask.{name.replace('/', '.')}", [f"vllm_sampling_mask/{name}.c"],
              depends=["vllm_sampling_mask/_slot_fields.h"], optional=True)
    for name in ("core/_hand_out_native", "engine/_take_rows_native")
])
