"""Triton sparse prefill kernel vs the float64 torch reference.

CPU: runs the kernel under Triton's interpreter (TRITON_INTERPRET=1) at tiny sizes when triton is
importable. GPU: realistic sizes, bf16/fp16. Each case draws random block masks, columns and
key ranges (:func:`index_of` builds the index from the format's definition), several rows per
batch with q_len / ctx_len off multiples of 64, a paged cache with a random page permutation
whose unused slots hold NaN, and an output poisoned with NaN; every token of every row must be
written, tokens outside the rows untouched.

Without CUDA this module sets TRITON_INTERPRET=1 (before the kernels are imported) for the
whole pytest process. The project venv has no triton: everything here is skipped there.
"""

from __future__ import annotations

import math

import pytest
import torch

from triton_setup import CUDA, INTERPRET, kernel_module

from vllm_sparse_kernels.kv_layout import gather_paged_kv
from vllm_sparse_kernels.reference.dense import sparse_attention_lse
from vllm_sparse_kernels.torch_attention import sparse_attention

from kernel_helpers import make_cache, quantize_cache
from vllm_sparse_kernels.index_format import (SparseIndex, causal_block_mask, num_blocks, query_block_bounds,
                                              range_stops)

pytestmark = pytest.mark.kernels  # `make test` runs these with triton, under its interpreter on CPU

sa = kernel_module("prefill.attention")
sv = kernel_module("prefill.variants")
DEV = "cuda" if CUDA and not INTERPRET else "cpu"
GAP = 3  # tokens between rows in q/out that belong to no row




def _lists(values: torch.Tensor, keep: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(count int32 [...], ascending kept values int32 [..., max count], -1 padded) per last-dim row."""
    count = keep.sum(-1)
    width = int(count.max()) if count.numel() else 0
    big = torch.iinfo(torch.int64).max
    kept = torch.where(keep, values.to(torch.int64), big).sort(-1).values[..., :width]
    return count.to(torch.int32), torch.where(kept == big, -1, kept).to(torch.int32)


def index_of(mask, q_len, ctx_len, cols=None, keep=None, range_start=None) -> SparseIndex:
    """A SparseIndex in the format's terms (index_format), built here so that the kernel tests
    need nothing of the plugin: the causal key blocks of ``mask`` [H, NQB, NKB]; the ascending
    range starts ``range_start`` [H, NQB, R] (-1 padded; each range cut where the next starts);
    each kept column candidate (``cols`` / ``keep`` [H, C]) listed once for the query blocks that
    can see it and whose blocks and ranges do not already cover it."""
    h, nqb, nkb = mask.shape
    kv_len = ctx_len + q_len
    _, q_last = query_block_bounds(q_len, ctx_len, 64)
    mask = mask & causal_block_mask(q_len, ctx_len, 64)[None]
    block_count, block_index = _lists(torch.arange(nkb).expand(h, nqb, nkb), mask)
    if range_start is None:
        range_start = torch.full((h, nqb, 0), -1, dtype=torch.int32)
    start = range_start.to(torch.int64)
    ok = start >= 0
    edge = torch.zeros(h, nqb, kv_len + 1, dtype=torch.int64)  # +1 at each range's start, -1 at its stop
    edge.scatter_add_(-1, torch.where(ok, start, kv_len), ok.long())
    edge.scatter_add_(-1, torch.where(ok, range_stops(start, 64).clamp(max=kv_len), kv_len), -ok.long())
    in_range = edge[..., :kv_len].cumsum(-1) > 0
    chosen = torch.zeros(h, kv_len, dtype=torch.bool)
    if cols is not None:
        chosen[torch.arange(h)[:, None].expand_as(cols)[keep], cols[keep]] = True
    in_block = mask.repeat_interleave(64, -1)[..., :kv_len]
    listed = chosen[:, None, :] & (torch.arange(kv_len) <= q_last[:, None]) & ~in_block & ~in_range
    column_count, column_index = _lists(torch.arange(kv_len).expand(h, nqb, kv_len), listed)
    return SparseIndex(64, block_count, block_index, column_count, column_index, ok.sum(-1).to(torch.int32),
                       range_start.to(torch.int32))


def random_index(h, q_len, ctx_len, density, n_cols, gen, device, ranges=False):
    """Random key blocks and columns; ``ranges``: odd heads list key ranges instead of blocks,
    from random starts (a share ``density / 16`` of the causal keys, so that some ranges are cut
    short by the next one and some run their full 64 keys) plus one at each query block's first
    position, so that every query sees its own key."""
    nqb, nkb = num_blocks(q_len, 64), num_blocks(ctx_len + q_len, 64)
    mask = torch.rand(h, nqb, nkb, generator=gen) < density
    cols = torch.randint(0, ctx_len + q_len, (h, n_cols), generator=gen)
    keep = torch.rand(h, n_cols, generator=gen) < 0.8
    if not ranges:
        return index_of(mask, q_len, ctx_len, cols, keep).to(device)
    kv_len = ctx_len + q_len
    q_first, q_last = query_block_bounds(q_len, ctx_len, 64)
    pick = (torch.rand(h, nqb, kv_len, generator=gen) < density / 16) & (torch.arange(kv_len) <= q_last[:, None])
    pick[:, torch.arange(nqb), q_first] = True
    odd = torch.arange(h) % 2 == 1
    pick &= odd[:, None, None]
    mask &= ~odd[:, None, None]
    _, r_start = _lists(torch.arange(kv_len).expand(h, nqb, kv_len), pick)
    return index_of(mask, q_len, ctx_len, cols, keep, r_start).to(device)


def full_index(h, q_len, ctx_len, device):
    nqb, nkb = num_blocks(q_len, 64), num_blocks(ctx_len + q_len, 64)
    return index_of(torch.ones(h, nqb, nkb, dtype=torch.bool), q_len, ctx_len).to(device)


def run_case(shapes, hkv, group, d, page, dtype, seed, *, mode="sparse", layout="NHD", density=0.35,
             n_cols=24, softcap=0.0, merge=1, share=1, pack=True, check_lse=False, tol=None, device=DEV, whole=None,
             ranges=False, fp8=None, stack=None, **launch):
    """``fp8`` = (fp8 dtype, k_scale, v_scale): the cache holds K / k_scale and V / v_scale in
    fp8 (vLLM's fp8 KV cache), the scales reach the kernel as given (numbers or device tensors),
    and the reference attends over the dequantised K/V. ``stack`` (with ``share == group``):
    stack that many heads per program over the group's one list, padded where it does not
    divide the group (the list repeated for each program)."""
    gen = torch.Generator().manual_seed(seed)
    h = hkv * group
    kv_lens = [q + c for q, c in shapes]
    key_cache, value_cache, table, ks, vs = make_cache(kv_lens, hkv, d, page, dtype, layout, gen, device)
    if fp8 is not None:
        fp8_dtype, k_scale, v_scale = fp8
        key_cache, value_cache = quantize_cache(key_cache, value_cache, fp8_dtype, float(k_scale), float(v_scale),
                                                layout)
        launch.update(k_scale=k_scale, v_scale=v_scale)

        def dequant(k, v):
            return k.double() * float(k_scale), v.double() * float(v_scale)

        ks, vs = zip(*[dequant(*gather_paged_kv(key_cache, value_cache, table[i], n)) for i, n in enumerate(kv_lens)])
        ks, vs = [k.cpu() for k in ks], [v.cpu() for v in vs]
    rows, tok = [], GAP
    for i, (q_len, ctx) in enumerate(shapes):
        rows.append((i, tok, q_len, ctx))
        tok += q_len + GAP
    t = tok
    q = torch.randn(t, h, d, generator=gen).to(dtype).to(device)
    out = torch.full((t, h, d), float("nan"), dtype=dtype, device=device)
    scale = 1.0 / math.sqrt(d)
    if mode == "dense":
        indices = [full_index(h, q_len, ctx, device) for q_len, ctx in shapes]
        bix = sa.pack_rows(rows, None, device=device)
    else:
        # share > 1: one list per `share` heads of a group (pack_rows(heads_per_list=share)); the
        # reference gets each list repeated for its heads
        lists = [random_index(h // share, q_len, ctx, density, n_cols, gen, device, ranges) for q_len, ctx in shapes]
        indices = [ix.repeat_heads(share) for ix in lists]
        # pack=False: the launcher gets the per-row lists and picks the stacking itself
        if stack is not None:
            assert share == group
            bix = sa.pack_rows(rows, [ix.repeat_heads(-(-group // stack)) for ix in lists], device=device,
                               heads_per_list=stack)
        else:
            bix = sa.pack_rows(rows, lists, device=device, heads_per_list=share) if pack else lists
        if merge > 1:
            bix = sa.merge_group_heads(bix, merge)
    kw = {"heads_per_program": merge} if mode == "dense" else {}
    kw.update(launch)
    if whole is not None:  # flagged rows ignore their lists: every causal key
        kw["whole_rows"] = torch.tensor(whole, device=device)
        indices = [full_index(h, q_len, ctx, device) if w else ix for w, ix, (q_len, ctx) in zip(whole, indices, shapes)]
    res = sa.sparse_prefill_attention(q, key_cache, value_cache, table, rows, bix, scale, out,
                                      softcap=softcap, return_lse=check_lse, **kw)
    lse = res[1] if check_lse else None
    if check_lse:
        # the LSE comes from the tests' kernel (prefill/variants.py); the same launch
        # without it (the serving kernel, where the case is one serving runs) writes the same
        # output bit for bit
        again = torch.full_like(out, float("nan"))
        sa.sparse_prefill_attention(q, key_cache, value_cache, table, rows, bix, scale, again, softcap=softcap, **kw)
        torch.testing.assert_close(again, out, rtol=0, atol=0, equal_nan=True)
    if tol is None:
        tol = 1e-4 if dtype == torch.float32 and device == "cpu" else (3e-3 if dtype == torch.float32 else 1e-2)
    in_rows = torch.zeros(t, dtype=torch.bool)
    for (bt_row, t0, q_len, ctx), ix in zip(rows, indices):
        in_rows[t0:t0 + q_len] = True
        if fp8 is not None:
            k, v = dequant(*gather_paged_kv(key_cache, value_cache, table[bt_row], ctx + q_len))
        else:
            k, v = gather_paged_kv(key_cache, value_cache, table[bt_row], ctx + q_len)
        assert torch.equal(k.cpu(), ks[bt_row]) and torch.equal(v.cpu(), vs[bt_row])
        qr = q[t0:t0 + q_len]
        ref, _ = sparse_attention(qr.double(), k.double(), v.double(), ix, ctx, scale, softcap=softcap)
        got = out[t0:t0 + q_len]
        assert not torch.isnan(got).any(), "output not fully written (NaN left)"
        err = ((got.double() - ref).norm() / ref.norm().clamp_min(1e-30)).item()
        assert err < tol, f"row {bt_row} (q_len={q_len}, ctx={ctx}): rel err {err:.3e} >= {tol}"
        if check_lse:
            ref_lse = sparse_attention_lse(qr.cpu(), k.cpu(), v.cpu(), ix, ctx, scale, softcap)
            got_lse = lse[:, t0:t0 + q_len].double().cpu()
            fin = torch.isfinite(ref_lse)
            assert torch.equal(fin, torch.isfinite(got_lse))
            assert torch.allclose(got_lse[fin], ref_lse[fin], atol=2e-2 if dtype != torch.float32 else 1e-4)
    assert torch.isnan(out[~in_rows.to(out.device)]).all(), "wrote outside the rows"


# ------------------------------------------------------------------------------------------
# CPU (interpreter), tiny sizes
# ------------------------------------------------------------------------------------------

cpu_only = pytest.mark.skipif(not INTERPRET, reason="interpreter tests run only with TRITON_INTERPRET=1 (no CUDA)")
SMALL = [(70, 0), (37, 45), (130, 100)]  # (q_len, ctx_len), none multiples of 64


@cpu_only
@pytest.mark.parametrize("group,d,page,layout", [(1, 64, 16, "NHD"), (4, 64, 32, "HND"), (7, 128, 16, "HND"),
                                                 (4, 128, 32, "NHD")])
def test_interp_sparse_fp32(group, d, page, layout):
    run_case(SMALL, 1 if group != 1 else 2, group, d, page, torch.float32, seed=group * 100 + d + page,
             layout=layout)


@cpu_only
def test_interp_sparse_fp16():
    # (bf16 is checked on the GPU only: the interpreter's bf16 tl.dot returns garbage, seen with
    # triton 3.9 on CPU on a 16x16 product)
    run_case(SMALL, 1, 4, 64, 16, torch.float16, seed=7)


@cpu_only
def test_interp_empty_selection_gives_zeros():
    # sparse masks and no columns: some queries select nothing -> zero output, lse -inf
    run_case([(100, 30)], 1, 2, 64, 16, torch.float32, seed=3, density=0.15, n_cols=0, check_lse=True)


@cpu_only
@pytest.mark.parametrize("group,merge", [(1, 1), (4, 2), (7, 1), (7, 4), (2, 4)])
def test_interp_dense(group, merge):
    # merge = heads stacked per program; 7 with 4 and 2 with 4 exercise padded head slots
    run_case(SMALL, 1, group, 64, 32, torch.float32, seed=11 + group, mode="dense", merge=merge)


@cpu_only
def test_interp_merged_heads_lse_softcap():
    run_case(SMALL, 1, 4, 64, 16, torch.float32, seed=5, merge=4, check_lse=True, softcap=5.0)


@cpu_only
@pytest.mark.parametrize("mode,merge,kv_major,block_n,prefetch", [
    ("sparse", 1, True, 128, False), ("sparse", 2, False, 128, True), ("dense", 1, False, 128, False),
    ("dense", 4, True, 128, True), ("sparse", 1, True, 64, True), ("sparse", 4, True, 64, True),
    ("dense", 2, True, 64, True)])
def test_interp_launch_variants(mode, merge, kv_major, block_n, prefetch):
    run_case(SMALL, 1, 4, 64, 16, torch.float32, seed=21 + merge, mode=mode, merge=merge, block_n=block_n,
             kv_major=kv_major, prefetch=prefetch)


@cpu_only
@pytest.mark.parametrize("group,share,hkv", [(4, 4, 1), (4, 2, 2), (8, 4, 1)])
def test_interp_group_shared_lists(group, share, hkv):
    # one key list per `share` query heads of a KV group, the heads stacked in one program
    run_case(SMALL, hkv, group, 64, 16, torch.float32, seed=31 + share, share=share, check_lse=True)


@cpu_only
@pytest.mark.parametrize("mode,page,layout,share,merge", [
    ("sparse", 64, "NHD", 1, 1), ("sparse", 128, "HND", 2, 1), ("dense", 64, "NHD", 1, 2),
    ("sparse", 64, "HND", 1, 2)])
def test_interp_tma_tiles(mode, page, layout, share, merge):
    # listed blocks loaded through TMA descriptors (one box = 64 keys of one page); merge = 2
    # stacks heads (dense) or merges their lists (sparse); the diagonal tiles' keys past the row
    # end are real cache slots of the last page, which must not reach the output
    run_case(SMALL, 2, 4, 64, page, torch.float32, seed=61 + page + merge, mode=mode, layout=layout, share=share,
             merge=merge, tma=True, check_lse=True)


@cpu_only
def test_interp_tma_whole_rows_and_fp8():
    run_case([(130, 0), (70, 200)], 1, 2, 64, 64, torch.float32, seed=67, tma=True, whole=[False, True])
    run_case(SMALL, 1, 2, 64, 64, torch.float32, seed=68, tma=True, fp8=(torch.float8_e4m3fn, 0.5, 2.0))


@cpu_only
def test_interp_tma_refuses_what_it_cannot_read():
    # pages of 16 keys: a 64-key tile spans four pages, which one TMA box cannot load
    with pytest.raises(ValueError, match="pages of 16"):
        run_case(SMALL[:1], 1, 2, 64, 16, torch.float32, seed=69, tma=True)


@cpu_only
@pytest.mark.parametrize("group,stack", [(6, 4), (3, 2), (7, 4)])
def test_interp_padded_stack_shared_lists(group, stack):
    # one list per KV group, `stack` heads per program where `stack` does not divide the group:
    # the last program's padding rows are masked (nothing written for them, lse of real heads kept)
    run_case(SMALL, 2, group, 64, 16, torch.float32, seed=51 + group, share=group, stack=stack, check_lse=True)


@cpu_only
@pytest.mark.parametrize("group,d", [(4, 64), (6, 64), (4, 128), (8, 128), (6, 128), (7, 128)])
def test_interp_launcher_stacks_shared_lists(group, d):
    # one list per KV head handed to the launcher unpacked: it stacks up to 4 heads (d=128:
    # 4 of 4, 4 of 8, 2 of 6, 1 of 7; d=64: 4 or 1) and repeats the list for the remaining stacks
    run_case(SMALL[:2], 1, group, d, 16, torch.float32, seed=41 + group, share=group, pack=False)
    assert sa.shared_stack(d, group) == ({4: 4, 8: 4, 6: 2, 7: 1} if d == 128 else {4: 4, 8: 4, 6: 1, 7: 1})[group]


@cpu_only
@pytest.mark.parametrize("share", [1, 2])
def test_interp_whole_rows_run_every_causal_block(share):
    # the density fallback decided on the GPU: flagged rows (here the 2nd of 3, and a row with
    # context) attend to every causal key whatever their lists say, the others to their lists
    run_case([(130, 0), (70, 200), (64, 77)], 2, 2, 64, 16, torch.float32, seed=21, share=share,
             whole=[False, True, True] if share == 1 else [True, False, False])


@cpu_only
@pytest.mark.parametrize("group,d,block_n,share", [(2, 64, 64, 1), (2, 64, 128, 1), (4, 128, 64, 1), (4, 64, 64, 4),
                                                   (4, 128, 64, 2)])
def test_interp_key_ranges(group, d, block_n, share):
    # lists with key ranges (odd lists) beside lists with blocks, columns around both; one or
    # two ranges per key tile; per-head and KV-group-shared lists; a flagged row ignores them
    run_case(SMALL, 2, group, d, 16, torch.float32, seed=51 + group + d + block_n, ranges=True, density=0.3,
             share=share, block_n=block_n, check_lse=True)
    run_case(SMALL, 1, group, d, 16, torch.float32, seed=52, ranges=True, share=share, whole=[False, True, False])


@cpu_only
def test_interp_merge_refuses_key_ranges():
    gen = torch.Generator().manual_seed(0)
    ix = random_index(4, 130, 100, 0.3, 8, gen, "cpu", ranges=True)
    with pytest.raises(ValueError, match="without key ranges"):
        sa.merge_group_heads(sa.pack_rows([(0, 0, 130, 100)], [ix]), 2)


def test_pack_rows_puts_lists_of_unequal_widths_side_by_side():
    """Rows whose lists have different widths: each row's lists in its query blocks, -1 past
    its own width (what padding each row and concatenating gave, without the padded copies)."""
    gen = torch.Generator().manual_seed(3)
    rows = [(0, 0, 130, 100), (1, 130, 70, 900), (2, 200, 64, 0)]
    indices = [random_index(4, q, ctx, 0.3, 8, gen, "cpu", ranges=r) for (_, _, q, ctx), r in
               zip(rows, (True, False, True))]
    bix = sa.pack_rows(rows, indices)
    for name in ("block_index", "column_index", "range_start"):
        lists = [getattr(ix, name) for ix in indices]
        width = max(t.shape[-1] for t in lists)
        want = torch.cat([torch.nn.functional.pad(t, (0, width - t.shape[-1]), value=-1) for t in lists], 1)
        assert len({t.shape[-1] for t in lists}) > 1 or name == "range_start"
        assert torch.equal(getattr(bix, name), want.to(torch.int32)), name
    assert torch.equal(bix.block_count, torch.cat([ix.block_count for ix in indices], 1).to(torch.int32))


def _row_table_case(device=DEV, share=1):
    """A three-row step (one row of no queries) with per-row lists and whole-row flags."""
    gen = torch.Generator().manual_seed(21)
    hkv, group, d, page = 1, 2, 64, 16
    shapes = [(70, 0), (0, 30), (130, 100)]
    key_cache, value_cache, table, _, _ = make_cache([q + c for q, c in shapes], hkv, d, page, torch.float32, "NHD",
                                                     gen, device)
    rows, tok = [], GAP
    for i, (q_len, ctx) in enumerate(shapes):
        rows.append((i, tok, q_len, ctx))
        tok += q_len + GAP
    q = torch.randn(tok, hkv * group, d, generator=gen).to(device)
    lists = [random_index(hkv * group // share, q_len, ctx, 0.35, 8, gen, device, ranges=q_len > 0)
             for q_len, ctx in shapes]
    whole = torch.tensor([False, True, True], device=device)
    return dict(q=q, key_cache=key_cache, value_cache=value_cache, block_table=table, rows=rows, scale=d ** -0.5), \
        lists, whole


def test_plan_rows_holds_what_each_launch_built():
    """The planned table's metadata is the one pack_rows builds per launch, and its per-block row
    ids expand per-row flags as the launcher's per-row expansion does."""
    args, lists, whole = _row_table_case("cpu")
    table = sa.plan_rows(args["rows"], 64, "cpu")
    assert torch.equal(table.meta, sa.pack_rows(args["rows"], lists).meta)
    assert table.meta.is_contiguous() and table.meta.dtype == torch.int32
    assert table.query_blocks == (2, 0, 3) and table.num_query_blocks == 5
    per_row = torch.cat([whole[i].view(1).expand(n) for i, n in enumerate(table.query_blocks)]).to(torch.int32)
    assert torch.equal(table.block_flags(whole), per_row)
    empty = sa.plan_rows([], 64, "cpu")
    assert empty.meta.shape == (0, 5) and empty.block_rows.shape == (0,)


def test_row_table_refuses_other_rows():
    args, lists, _ = _row_table_case("cpu")
    table = sa.plan_rows(args["rows"], 64, "cpu")
    other = [(r[0], r[1], r[2], r[3] + 1) for r in args["rows"]]
    with pytest.raises(ValueError, match="planned for other rows"):
        sa.pack_rows(other, lists, row_table=table)
    with pytest.raises(ValueError, match="planned for 32-query blocks"):
        sa.pack_rows(args["rows"], None, device="cpu", block_size=64, row_table=sa.plan_rows(args["rows"], 32, "cpu"))


@cpu_only
@pytest.mark.parametrize("share", [1, 2])
def test_interp_row_table_gives_the_same_output(share):
    """A launch with the step's planned row table writes what a launch that builds its own writes,
    bit for bit: lists packed by the launcher, packed beforehand, and dense."""
    args, lists, whole = _row_table_case(share=share)
    table = sa.plan_rows(args["rows"], 64, args["q"].device)
    outs = []
    for row_table in (None, table):
        out = torch.full_like(args["q"], float("nan"))
        sa.sparse_prefill_attention(**args, index=lists, out=out, whole_rows=whole, row_table=row_table)
        outs.append(out)
    torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=0, equal_nan=True)
    packed = sa.pack_rows(args["rows"], lists, heads_per_list=share, row_table=table)
    if share == 1:
        out = torch.full_like(args["q"], float("nan"))
        sa.sparse_prefill_attention(**args, index=packed, out=out, whole_rows=whole, row_table=table)
        torch.testing.assert_close(out, outs[0], rtol=0, atol=0, equal_nan=True)
    dense = [torch.full_like(args["q"], float("nan")) for _ in range(2)]
    sa.sparse_prefill_attention(**args, index=None, out=dense[0])
    sa.sparse_prefill_attention(**args, index=sa.pack_rows(args["rows"], None, device=args["q"].device,
                                                          row_table=table), out=dense[1])
    torch.testing.assert_close(dense[0], dense[1], rtol=0, atol=0, equal_nan=True)


@cpu_only
def test_interp_row_table_is_reused_across_launches(monkeypatch):
    """Two launches (two layers of a step) with one planned table: both pack its very meta tensor,
    and nothing is built or copied to the device again (the host-to-device path is disabled)."""
    from vllm_sparse_kernels.prefill import packing

    args, lists, whole = _row_table_case()
    table = sa.plan_rows(args["rows"], 64, args["q"].device)

    def no_copy(*a, **k):
        raise AssertionError("the row table was built or copied again")

    monkeypatch.setattr(packing, "_meta_table", no_copy)
    monkeypatch.setattr(packing, "_to_device", no_copy)
    packed = []
    real_pack = sa.pack_rows

    def recording_pack(*a, **k):
        packed.append(real_pack(*a, **k))
        return packed[-1]

    monkeypatch.setattr(sa, "pack_rows", recording_pack)
    for _ in range(2):
        out = torch.full_like(args["q"], float("nan"))
        sa.sparse_prefill_attention(**args, index=lists, out=out, whole_rows=whole, row_table=table)
    assert len(packed) == 2 and all(bix.meta is table.meta for bix in packed)


@cpu_only
def test_interp_lse_sparse():
    run_case(SMALL[:2], 2, 2, 64, 32, torch.float32, seed=9, check_lse=True)


# fp8 KV cache (vLLM's --kv-cache-dtype fp8): stored = value / scale with one scale per layer for
# K and one for V; scales that are not powers of two, so that a scale applied twice or not at all
# (or k's where v's belongs) shows. Reference: float64 attention over the dequantised K/V.
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
SCALES = (0.043, 0.021)


def _dev_scales(device=DEV):
    return tuple(torch.tensor([s], dtype=torch.float32, device=device) for s in SCALES)


@cpu_only
@pytest.mark.parametrize("mode,share,merge,layout", [("sparse", 1, 1, "NHD"), ("sparse", 4, 1, "HND"),
                                                     ("sparse", 1, 2, "NHD"), ("dense", 1, 4, "HND")])
def test_interp_fp8_kv_cache(mode, share, merge, layout):
    # per-head lists, group-shared lists (4 heads stacked), merged heads, the dense mode; scales
    # as device tensors (what vLLM's layer holds)
    run_case(SMALL, 1, 4, 64, 16, torch.float32, seed=61 + share + merge, mode=mode, share=share, merge=merge,
             layout=layout, fp8=(E4M3, *_dev_scales()))


@cpu_only
@pytest.mark.parametrize("fp8", [E4M3, E5M2])
def test_interp_fp8_kv_cache_fp16_query(fp8):
    # tiles widened to the query's fp16 (both fp8 formats convert exactly); scales as numbers
    run_case(SMALL, 1, 4, 64, 16, torch.float16, seed=67, fp8=(fp8, *SCALES))


@cpu_only
def test_interp_fp8_kv_cache_lse_softcap_whole_rows():
    # the k scale is inside the soft-capped scores and the LSE; flagged rows run every causal key
    run_case([(130, 0), (70, 200)], 2, 2, 128, 16, torch.float32, seed=71, softcap=5.0, check_lse=True,
             whole=[False, True], fp8=(E4M3, *_dev_scales()))


@cpu_only
def test_interp_fp8_kv_cache_without_scales_reads_stored_values():
    # no scales given: the stored values are the values (scale 1)
    run_case(SMALL[:2], 1, 2, 64, 16, torch.float32, seed=73, fp8=(E4M3, 1.0, 1.0))


class _LaunchSpy:
    """Stands in for one of the module's kernels and notes each launch (the launcher looks the
    kernels up as module globals at every call)."""

    def __init__(self, kernel, name, log):
        self.kernel, self.name, self.log = kernel, name, log

    def __getitem__(self, grid):
        self.log.append(self.name)
        return self.kernel[grid]


@cpu_only
@pytest.mark.parametrize("case,kernels", [
    (dict(), ["serving"]),  # per-head lists, the default launch
    (dict(share=2, whole=[True], softcap=5.0, fp8=(E4M3, 0.5, 2.0)), ["serving"]),
    (dict(page=64, tma=True), ["serving"]),
    (dict(page=64, tma=True, prefetch=False), ["serving"]),  # the TMA branch prefetches anyway
    (dict(block_n=128), ["serving"]),
    (dict(prefetch=False), ["variants"]),
    (dict(kv_major=False), ["variants"]),
    (dict(mode="dense", merge=2), ["variants"]),
    (dict(merge=2), ["variants"]),
    (dict(check_lse=True), ["variants", "serving"]),  # the LSE launch, then run_case's same launch without
])
def test_interp_launcher_picks_the_serving_kernel(monkeypatch, case, kernels):
    # the serving kernel has none of the modes serving never runs (dense, merged heads, LSE, the
    # other program order, no prefetch): those launch _sparse_fwd_variants_kernel
    log = []
    for kind, module, name in (("serving", sa, "_sparse_fwd_kernel"),
                               ("variants", sv, "_sparse_fwd_variants_kernel")):
        monkeypatch.setattr(module, name, _LaunchSpy(getattr(module, name), kind, log))
    case = dict(case)
    page = case.pop("page", 16)
    run_case([(70, 30)], 1, 2, 64, page, torch.float32, seed=81, **case)
    assert log == kernels


def _launch_args(d=64, page=16, t=70):
    """A valid CPU launch (not run): one row of t queries, no context, per-head lists."""
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(t, 2, d, generator=gen)
    cache = torch.zeros(8, page, 1, d)
    ix = random_index(2, t, 0, 0.5, 4, gen, "cpu")
    return dict(q=q, key_cache=cache, value_cache=cache.clone(), block_table=torch.zeros(1, 8, dtype=torch.int32),
                rows=[(0, 0, t, 0)], index=[ix], scale=0.125, out=torch.empty_like(q))


def _packed(args, **change):
    import dataclasses
    bix = sa.pack_rows(args["rows"], args["index"])
    return dataclasses.replace(bix, **{k: f(getattr(bix, k)) for k, f in change.items()})


@pytest.mark.parametrize("change,match", [
    (lambda a: a.update(q=a["q"][:, 0]), r"q: \[tokens, heads, head_dim\] expected"),
    (lambda a: a.update(out=a["out"][:, :, :32]), r"out: \[tokens, 2, 64\] expected .the query's heads"),
    (lambda a: a.update(out=a["out"][:60]), "rows: tokens 0..69 .context 0. outside the 60 of q and out"),
    (lambda a: a.update(out=a["out"].to(torch.int32)), "out: fp16, bf16 or fp32 expected"),
    (lambda a: a.update(key_cache=a["key_cache"][0]), "key_cache: a .num_pages, page_size, kv_heads, head_dim. view"),
    (lambda a: a.update(value_cache=a["value_cache"][:4]), "value_cache: the key cache's shape"),
    (lambda a: a.update(key_cache=a["key_cache"][..., :32], value_cache=a["value_cache"][..., :32]),
     "key_cache: head size 32, the query's is 64"),
    (lambda a: a.update(q=a["q"][..., :48], out=a["out"][..., :48], key_cache=a["key_cache"][..., :48],
                        value_cache=a["value_cache"][..., :48]), "q: head size 48 not supported"),
    (lambda a: a.update(key_cache=a["key_cache"][:, :12], value_cache=a["value_cache"][:, :12]),
     "key_cache: page size 12 must be a power of two"),
    (lambda a: a.update(q=torch.zeros(70, 3, 64), out=torch.empty(70, 3, 64), key_cache=torch.zeros(8, 16, 2, 64),
                        value_cache=torch.zeros(8, 16, 2, 64)),
     "q: 3 query heads not a multiple of the caches' 2 KV heads"),
    (lambda a: a.update(block_table=a["block_table"].long()), "block_table: int32 .num_reqs, max_pages. expected"),
    (lambda a: a.update(block_table=torch.zeros(8, 2, dtype=torch.int32).t()), "block_table: a row's pages must be"),
    (lambda a: a.update(rows=[(0, 10, 70, 0)]), "rows: tokens 10..79 .context 0. outside the 70 of q and out"),
    (lambda a: a.update(rows=[(1, 0, 70, 0)]), "rows: block-table row 1 with 70 keys, the table is 1 x 8"),
    (lambda a: a.update(rows=[(0, 0, 70, 100)]), "rows: block-table row 0 with 170 keys, the table is 1 x 8"),
    (lambda a: a.update(index=_packed(a, block_count=lambda x: x.long())),
     "index.block_count: a contiguous int32 tensor on cpu expected, got torch.int64"),
    (lambda a: a.update(index=_packed(a, block_index=lambda x: x.transpose(0, 1).contiguous().transpose(0, 1))),
     "index.block_index: a contiguous int32 .*not contiguous"),
    (lambda a: a.update(index=_packed(a, column_count=lambda x: x[:1])),
     r"index.column_count: 2 x 2 expected \(2 lists of 2 query blocks\), got \(1, 2\)"),
    (lambda a: a.update(index=_packed(a, meta=lambda x: x[:, :4])), "index.meta: 2 x 5 expected"),
])
def test_launcher_checks_its_arguments(change, match):
    # once per launch, before anything runs: a ValueError naming the argument
    args = _launch_args()
    change(args)
    with pytest.raises(ValueError, match=match):
        sa.sparse_prefill_attention(**args)


def test_launcher_checks_accept_a_valid_launch():
    args = _launch_args()
    sa._check_operands(args["q"], args["key_cache"], args["value_cache"], args["block_table"], args["out"])
    sa._check_rows(args["rows"], 70, args["block_table"], 16)
    sa._check_index(_packed(args), 2, args["q"].device)


def test_fp8_query_is_refused():
    q = torch.zeros(64, 2, 64).to(E4M3)
    cache = torch.zeros(2, 16, 1, 64)
    with pytest.raises(ValueError, match="query dtype"):
        sa.sparse_prefill_attention(q, cache, cache, torch.zeros(1, 4, dtype=torch.int32), [(0, 0, 64, 0)], None,
                                    0.125, torch.empty(64, 2, 64))
    with pytest.raises(ValueError, match="one KV scale per layer"):
        sa.sparse_prefill_attention(q.float(), cache, cache, torch.zeros(1, 4, dtype=torch.int32), [(0, 0, 64, 0)],
                                    None, 0.125, torch.empty(64, 2, 64), k_scale=torch.ones(2))


# ------------------------------------------------------------------------------------------
# GPU, realistic sizes
# ------------------------------------------------------------------------------------------

def gpu(fn):
    return pytest.mark.gpu(pytest.mark.skipif(not CUDA or INTERPRET, reason="needs CUDA (and TRITON_INTERPRET unset)")(fn))
BIG = [(3000, 0), (1500, 2100), (777, 5000)]


@gpu
@pytest.mark.parametrize("group,d,page,dtype", [(4, 128, 16, torch.bfloat16), (7, 64, 32, torch.bfloat16),
                                                (1, 128, 32, torch.float16), (4, 64, 16, torch.float16)])
def test_gpu_sparse(group, d, page, dtype):
    run_case(BIG, 2, group, d, page, dtype, seed=group + d + page, density=0.2, n_cols=300, layout="HND")
    run_case(BIG, 2, group, d, page, dtype, seed=group + d + page + 1, density=0.2, n_cols=300, block_n=128,
             prefetch=True)


@gpu
@pytest.mark.parametrize("group,merge", [(4, 1), (4, 2), (4, 4), (7, 1), (7, 4)])
def test_gpu_dense(group, merge):
    run_case(BIG, 2, group, 128, 16, torch.bfloat16, seed=group + merge, mode="dense", merge=merge)
    run_case(BIG, 2, group, 128, 16, torch.bfloat16, seed=group + merge, mode="dense", merge=merge, block_n=128)


@gpu
@pytest.mark.parametrize("group,share,d", [(4, 4, 128), (4, 2, 128), (8, 4, 64)])
def test_gpu_group_shared_lists(group, share, d):
    run_case(BIG, 2, group, d, 16, torch.bfloat16, seed=group * share + d, share=share, density=0.2, n_cols=300)


@gpu
@pytest.mark.parametrize("mode,share,d,layout", [("sparse", 1, 128, "NHD"), ("sparse", 2, 128, "HND"),
                                                 ("dense", 1, 128, "NHD"), ("sparse", 1, 64, "NHD")])
def test_gpu_tma_tiles(mode, share, d, layout):
    run_case(BIG, 2, 6, d, 64, torch.bfloat16, seed=70 + share + d, mode=mode, share=share, density=0.2,
             n_cols=300, layout=layout, merge=2 if mode == "dense" else 1, tma=True, check_lse=True)
    run_case(BIG[1:], 2, 6, d, 128, torch.bfloat16, seed=71 + share + d, mode=mode, share=share, density=0.2,
             n_cols=300, layout=layout, tma=True, fp8=(E4M3, *_dev_scales("cuda")), whole=None if mode == "dense"
             else [True, False])


@gpu
@pytest.mark.parametrize("group,stack", [(6, 4), (6, 2)])
def test_gpu_padded_stack_shared_lists(group, stack):
    run_case(BIG, 2, group, 128, 16, torch.bfloat16, seed=group * stack, share=group, stack=stack, density=0.2,
             n_cols=300)


@gpu
@pytest.mark.parametrize("share", [1, 4])
def test_gpu_whole_rows_run_every_causal_block(share):
    run_case([(1000, 0), (700, 3000), (2000, 500)], 2, 4, 128, 16, torch.bfloat16, seed=22, share=share,
             whole=[False, True, False] if share == 1 else [True, False, True])


@gpu
@pytest.mark.parametrize("group,d,share", [(4, 128, 1), (4, 128, 4), (7, 64, 1), (8, 64, 4)])
def test_gpu_key_ranges(group, d, share):
    run_case(BIG, 2, group, d, 16, torch.bfloat16, seed=group + d + share, ranges=True, density=0.2, n_cols=300,
             share=share, layout="HND")


@gpu
def test_gpu_merged_lse_softcap():
    run_case(BIG[1:2], 2, 4, 128, 16, torch.bfloat16, seed=1, merge=4, density=0.2, n_cols=300, softcap=30.0,
             check_lse=True)


@gpu
@pytest.mark.parametrize("group,share,d,mode", [(4, 4, 128, "sparse"), (4, 1, 128, "sparse"), (7, 1, 64, "sparse"),
                                                (4, 1, 128, "dense")])
def test_gpu_fp8_kv_cache(group, share, d, mode):
    run_case(BIG, 2, group, d, 16, torch.bfloat16, seed=group + share + d, mode=mode, share=share, density=0.2,
             n_cols=300, merge=4 if mode == "dense" else 1, fp8=(E4M3, *_dev_scales("cuda")))
    run_case(BIG[1:], 2, group, d, 32, torch.float16, seed=group + d + 1, mode=mode, share=share, density=0.2,
             n_cols=300, layout="HND", fp8=(E4M3, *SCALES), check_lse=True, softcap=30.0 if mode == "sparse" else 0.0)
