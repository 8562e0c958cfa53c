"""The sparse prefill kernel's launch table (vllm_sparse_kernels/prefill/launch_config.py) gives,
for every input, the configuration the if/else decision tree it replaced gave: a frozen copy of
those results (tests/data/launch_config_expected.txt, written from the old function over this
input space) is compared entry by entry. Plain Python: no triton needed."""

from __future__ import annotations

import itertools

from repo_files import TEST_DATA
from vllm_sparse_kernels.prefill.launch_config import LAUNCH_TABLE, default_config, shared_stack

EXPECTED = TEST_DATA / "launch_config_expected.txt"
HEAD_DIMS = (16, 32, 64, 128, 256)
GROUPS = (1, 2, 3, 4, 5, 6, 7, 8, 12, 16)
MERGED_HEADS = (1, 2, 4, 8)
FLAGS = (False, True)
KEYS = ("heads_per_program", "num_warps", "num_stages", "block_n", "kv_major", "prefetch")


def _expected() -> dict[tuple, tuple]:
    table = {}
    for line in EXPECTED.read_text().splitlines():
        if not line.strip() or line.startswith("#"):
            continue
        inputs, outputs = line.split("->")
        table[tuple(int(x) for x in inputs.split())] = tuple(int(x) for x in outputs.split())
    return table


def test_default_config_matches_the_frozen_table_for_every_input():
    expected = _expected()
    space = list(itertools.product(HEAD_DIMS, FLAGS, GROUPS, MERGED_HEADS, FLAGS, FLAGS))
    assert len(expected) == len(space)
    wrong = []
    for head_dim, dense, group, merged, shared, tma in space:
        cfg = default_config(head_dim, dense, group, merged, shared=shared, tma=tma)
        got = tuple(int(cfg[k]) for k in KEYS)
        want = expected[(head_dim, int(dense), group, merged, int(shared), int(tma))]
        if got != want:
            wrong.append(((head_dim, dense, group, merged, shared, tma), got, want))
    assert not wrong, wrong[:10]


def test_every_row_of_the_table_is_reachable():
    used = set()
    for head_dim, dense, group, merged, shared, tma, quantized in itertools.product(
            HEAD_DIMS, FLAGS, GROUPS, MERGED_HEADS, FLAGS, FLAGS, FLAGS):
        conditions = dict(tma=tma, dense=dense, wide=head_dim >= 128, stacked=merged > 1, shared=shared,
                          quantized=quantized)
        used.add(next(i for i, r in enumerate(LAUNCH_TABLE) if r.matches(**conditions)))
    assert used == set(range(len(LAUNCH_TABLE)))


def test_an_fp8_cache_stacks_a_group_divisor_in_tma_dense_mode_only():
    """fp8 K/V tiles are widened once per program: dense mode on TMA loads stacks the largest of
    4 / 2 / 1 dividing the group (two heads for the 1.5B's group of 6, where bf16 keeps one); every
    other input gets the bf16 cache's configuration."""
    assert default_config(128, True, 6, tma=True, quantized=True)["heads_per_program"] == 2
    assert default_config(128, True, 6, tma=True)["heads_per_program"] == 1
    assert default_config(128, True, 2, tma=True, quantized=True)["num_warps"] == 8
    changed = []
    for head_dim, dense, group, merged, shared, tma in itertools.product(HEAD_DIMS, FLAGS, GROUPS, MERGED_HEADS,
                                                                         FLAGS, FLAGS):
        plain = default_config(head_dim, dense, group, merged, shared=shared, tma=tma)
        fp8 = default_config(head_dim, dense, group, merged, shared=shared, tma=tma, quantized=True)
        if fp8 != plain:
            changed.append((head_dim, dense, group, tma))
            assert (head_dim >= 128, dense, tma) == (True, True, True)
    assert {g for _, _, g, _ in changed} == {2, 6}


def test_shared_stack():
    # wide heads: the largest power of two up to 4 dividing the list's heads; narrow: 4 or none
    assert [shared_stack(128, n) for n in (1, 2, 3, 4, 6, 8, 12)] == [1, 2, 1, 4, 2, 4, 4]
    assert [shared_stack(64, n) for n in (1, 2, 3, 4, 6, 8, 12)] == [1, 1, 1, 4, 1, 4, 4]
