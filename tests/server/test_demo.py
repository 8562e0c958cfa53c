"""The README's demo, for real: SmolLM2-135M-Instruct (fetched from PyPI, converted, cached)
served by vLLM with --attention-backend sparse-prefill finds a passkey in Jane Austen."""

import re
import subprocess
import sys

import pytest

pytest.importorskip("vllm")
pytestmark = [pytest.mark.server, pytest.mark.slow]


def test_demo_finds_the_passkey_with_sparse_prefill():
    proc = subprocess.run([sys.executable, "-m", "vllm_sparse_tools.demo", "--tokens", "3000"],
                          capture_output=True, text=True, timeout=1500)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert re.search(r"^answer:  .* -> CORRECT$", out, re.M), out
    skipped = re.search(r"attention skipped: ([0-9.]+)%", out)
    assert skipped and float(skipped.group(1)) > 5.0, out
    sparse_tokens = re.search(r"query tokens \(summed over layers\): ([0-9,]+) sparse", out)
    # every one of SmolLM2's 30 layers ran the prompt through the sparse path
    assert sparse_tokens and int(sparse_tokens.group(1).replace(",", "")) >= 30 * 2900, out
    # then the same request on vLLM's own attention, and both times side by side
    assert re.search(r"^dense:   answer .* -> (CORRECT|WRONG)$", out, re.M), out
    times = re.search(r"speed:   sparse-prefill ([0-9.]+) s, vLLM's own attention ([0-9.]+) s", out)
    assert times, out
    sparse_s, dense_s = float(times.group(1)), float(times.group(2))
    meaning = out[times.end():].splitlines()[1].strip()
    said = re.match(r"sparse-prefill was ([0-9.]+)x (slower|faster)", meaning)
    if sparse_s > 1.15 * dense_s:  # (the printed times are rounded)
        assert said and said.group(2) == "slower", out
        assert abs(float(said.group(1)) - sparse_s / dense_s) < 0.15, out
    elif sparse_s < dense_s / 1.15:
        assert said and said.group(2) == "faster", out
