"""One-off investigations behind design decisions (``python -m benchmarks.studies.X``); their
findings are recorded in benchmarks/KERNEL_NOTES.md and the README. No test imports them."""
