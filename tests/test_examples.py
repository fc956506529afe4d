"""The examples run as a user runs them: a fresh process, the tiny model, the real exit status."""

from __future__ import annotations

import math
import re
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
# The same weights score and sample (fp32): the kept-set ratio is 1 up to float rounding.
RATIO_ARGS = ("--max-ratio-error", "0.001")


def run_example(name: str, model: str, env: dict[str, str], tmp_path: Path) -> str:
    result = subprocess.run([sys.executable, str(EXAMPLES / name), model, *RATIO_ARGS],
                            capture_output=True, text=True, env=env, cwd=tmp_path, timeout=600)
    assert result.returncode == 0, (result.stdout[-3000:], result.stderr[-3000:])
    return result.stdout


def check_summary(stdout: str) -> None:
    assert "8 completions, 64 tokens" in stdout  # 2 prompts x 4 samples x 8 tokens
    kept = re.search(r"on the kept set: +mean ([0-9.]+)", stdout)
    full = re.search(r"on the full vocab: mean ([0-9.]+) \(the kept probability mass, ([0-9.]+)",
                     stdout)
    gradient = re.search(r"gradient norm ([0-9.]+)", stdout)
    assert kept and full and gradient, stdout[-2000:]
    assert float(kept.group(1)) == pytest.approx(1.0, abs=1e-3)
    # top_k / top_p truncate: pi_theta on the full vocabulary is biased by the kept mass.
    assert float(full.group(1)) < 0.99 and float(full.group(1)) == pytest.approx(
        float(full.group(2)), abs=1e-3)
    assert math.isfinite(float(gradient.group(1))) and float(gradient.group(1)) > 0


@pytest.mark.slow
def test_rollout_and_score(tiny_model_dir: str, subprocess_env: dict, tmp_path: Path) -> None:
    check_summary(run_example("rollout_and_score.py", tiny_model_dir, subprocess_env, tmp_path))


@pytest.mark.slow
def test_http_rollout(tiny_model_dir: str, subprocess_env: dict, tmp_path: Path) -> None:
    stdout = run_example("http_rollout.py", tiny_model_dir, subprocess_env, tmp_path)
    assert "--return-sampling-mask" in stdout  # it started its own server
    check_summary(stdout)


def test_report_exit_status_fails_on_a_biased_ratio_or_a_non_finite_loss(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(EXAMPLES))
    from grpo_step import report

    def metrics(kept_ratio: float, loss: float) -> dict:
        ratios = {"ratio_mean": kept_ratio, "log_ratio_abs_max": 0.0}
        return {"sequences": 1, "tokens": 1, "loss": loss, "grad_norm": 1.0,
                "kept_set": ratios, "full_vocab": ratios, "kept_mass_mean": 1.0}

    assert report(metrics(1.0, 0.5), max_ratio_error=0.001) == 0
    assert report(metrics(0.9, 0.5), max_ratio_error=0.001) == 1
    assert report(metrics(0.9, 0.5), max_ratio_error=None) == 0
    assert report(metrics(1.0, math.nan), max_ratio_error=0.001) == 1
