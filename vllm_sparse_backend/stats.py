"""Counters of what the sparse path did, per worker process.

Kept in one small object that the backends update after each sparse forward. When the
``stats_file`` setting is set, the worker rewrites that JSON file (atomically) so that a client
such as the demo or a test can read what happened inside the server.
"""

from __future__ import annotations

import json
import os
import threading
from collections import Counter
from dataclasses import dataclass, field


@dataclass
class SparseStats:
    sparse_rows: int = 0  # (row, layer) pairs computed sparse
    sparse_query_tokens: int = 0  # query tokens x layers computed sparse
    dense_query_tokens: int = 0  # query tokens x layers sent to the dense kernel while sparse was on
    causal_pairs: int = 0  # (query, key) pairs x heads dense causal attention would compute for sparse rows
    computed_pairs: int = 0  # of those, the pairs the sparse selection computed
    head_patterns: Counter = field(default_factory=Counter)  # heads x rows per pattern
    dense_reasons: Counter = field(default_factory=Counter)  # long rows kept dense, by reason
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def as_dict(self) -> dict:
        return {
            "pid": os.getpid(),
            "sparse_rows": self.sparse_rows,
            "sparse_query_tokens": self.sparse_query_tokens,
            "dense_query_tokens": self.dense_query_tokens,
            "causal_pairs": self.causal_pairs,
            "computed_pairs": self.computed_pairs,
            "density": self.computed_pairs / self.causal_pairs if self.causal_pairs else None,
            "head_patterns": dict(self.head_patterns),
            "dense_reasons": dict(self.dense_reasons),
        }

    def dump(self, path: str) -> None:
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            json.dump(self.as_dict(), f)
        os.replace(tmp, path)


STATS = SparseStats()
