"""One-off investigations behind design decisions (``python -m benchmarks.studies.X``); their
findings are recorded in docs/history/kernel-notes.md. No test imports them."""
