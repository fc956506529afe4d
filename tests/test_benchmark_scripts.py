"""Benchmark scripts that run on CPU in seconds, run as a user runs them (a fresh process), so a
change to the code they drive can't leave them broken until the next GPU session."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def test_host_overhead_smoke_run(subprocess_env: dict[str, str], tmp_path: Path) -> None:
    # The script checks its own hops (rows unpacked, handed out, attached) against the worker's.
    out = tmp_path / "host_overhead.json"
    result = subprocess.run([sys.executable, str(BENCHMARKS / "bench_host_overhead.py"), "--small",
                             "--out", str(out)], capture_output=True, text=True, env=subprocess_env,
                            cwd=tmp_path, timeout=300)
    assert result.returncode == 0, (result.stdout[-3000:], result.stderr[-3000:])
    report = json.loads(out.read_text())
    assert set(report["per_process_ms"]) == {"engine_core", "frontend"}
    assert {"unpack", "unpack_overflow", "scheduler", "frontend", "attach"} <= set(report["results"])
    assert report["target_met"] is None  # --small: fewer requests than the targets' 512
