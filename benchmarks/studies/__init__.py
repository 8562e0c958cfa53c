"""One-off investigations (``python -m benchmarks.studies.X``); an answered one leaves once its
finding is in docs/ (git history keeps the script). No test imports them."""
