"""The trainer library must not pull in vLLM, Triton or transformers."""

import json
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]


def test_import_leaves_vllm_triton_and_transformers_out() -> None:
    code = (
        "import json, sys\n"
        "import vllm_sampling_mask.training\n"
        "import vllm_sampling_mask.training.audit\n"
        "print(json.dumps([m for m in ('vllm', 'triton', 'transformers') if m in sys.modules]))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            check=True, cwd=REPO_ROOT)
    assert json.loads(result.stdout.strip().splitlines()[-1]) == []
