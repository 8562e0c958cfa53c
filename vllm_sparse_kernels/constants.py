"""Named constants of the Triton kernels, each defined once.

``tl.constexpr`` globals, the only globals a ``@triton.jit`` function may read (this module
imports triton). Host code that needs the plain number reads ``.value``.
"""

from __future__ import annotations

import triton.language as tl

# Queries per query block, and keys per listed key block or key range, of the sparse index the
# prefill kernel reads (SparseIndex.block_size): one 64-key tile is one TMA box.
BLOCK: tl.constexpr = tl.constexpr(64)

# A key position past any real one: the end of the last key range of a list, the fill of
# searches over sorted positions or diagonals (-BIG_KEY: before any).
BIG_KEY: tl.constexpr = tl.constexpr(2**30)

# The online softmax runs in the log2 domain: exp(x) = exp2(x * LOG2E), ln(x) = log2(x) * LN2.
LOG2E: tl.constexpr = tl.constexpr(1.4426950408889634)
LN2: tl.constexpr = tl.constexpr(0.6931471805599453)

# Score of a masked (query, key) pair; log-sum-exp of a query that selected nothing.
NEG_INF: tl.constexpr = tl.constexpr(float("-inf"))

# Running row maximum before any key: finite, so that a tile whose scores are all masked leaves
# the rescale factor exp(m - m_new) at 1 and its probabilities at 0, not NaN (-inf - -inf).
MAX_START: tl.constexpr = tl.constexpr(-1.0e30)
