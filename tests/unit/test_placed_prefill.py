"""Prefill over pages chosen by their key summaries (issue 54 item 3, ``host_kv_prefill_pages``):
the bound each summary gives, which pages a chunk reads, and its attention against float64 over
exactly those keys (and over all of them when every page is read)."""

from __future__ import annotations

import pytest
import torch

from vllm_sparse_backend.prefill.placed import page_attention_bound, selected_prefill_placed

H, HKV, D, PAGE = 4, 2, 16, 4


def reference(q: torch.Tensor, key: torch.Tensor, value: torch.Tensor, positions: torch.Tensor,
              q_positions: torch.Tensor, scale: float) -> torch.Tensor:
    """float64 attention of queries at ``q_positions`` over keys at ``positions`` (causal by position)."""
    group = q.shape[1] // key.shape[1]
    k, v = key.double().repeat_interleave(group, 1), value.double().repeat_interleave(group, 1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) * scale
    scores = scores.masked_fill(positions[None, None, :] > q_positions[None, :, None], float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


class Pool:
    """One sequence's K/V in pages whose block ids are scrambled, as vLLM hands them out; the
    block ids each gather read."""

    def __init__(self, key: torch.Tensor, value: torch.Tensor, gen: torch.Generator):
        pages = -(-key.shape[0] // PAGE)
        self.table = torch.randperm(pages + 5, generator=gen)[:pages]  # block id of page p
        self.key = torch.zeros(pages + 5, PAGE, HKV, D)
        self.value = torch.zeros_like(self.key)
        for p in range(pages):
            n = min(PAGE, key.shape[0] - p * PAGE)
            self.key[self.table[p], :n] = key[p * PAGE:p * PAGE + n]
            self.value[self.table[p], :n] = value[p * PAGE:p * PAGE + n]
            self.key[self.table[p], n:] = 1e4  # stale slots past the sequence: must never be attended
        filled = [min(PAGE, key.shape[0] - p * PAGE) for p in range(pages)]
        self.min = torch.stack([self.key[b, :n].amin(0) for b, n in zip(self.table.tolist(), filled)])
        self.max = torch.stack([self.key[b, :n].amax(0) for b, n in zip(self.table.tolist(), filled)])
        self.reads: list[list[int]] = []

    def gather(self, blocks: list[int]):
        self.reads.append(blocks)
        return self.key[blocks].flatten(0, 1), self.value[blocks].flatten(0, 1)

    def summaries(self, blocks: torch.Tensor):
        page_of = {b: p for p, b in enumerate(self.table.tolist())}
        pages = torch.tensor([page_of[b] for b in blocks.tolist()])
        return self.min[pages], self.max[pages]

    def pages_read(self) -> list[int]:
        page_of = {b: p for p, b in enumerate(self.table.tolist())}
        return [page_of[b] for b in self.reads[-1]]


def run(pool: Pool, q: torch.Tensor, seq_len: int, budget: int, sinks: int = 1, recent: int = 2) -> torch.Tensor:
    out = torch.full_like(q, float("nan"))
    selected_prefill_placed(q, [0, q.shape[0]], [seq_len], pool.table[None, :], PAGE, D ** -0.5, out, pool.gather,
                            pool.summaries, budget, sinks, recent)
    return out


def test_the_bound_is_at_least_every_keys_score_and_exact_for_a_page_of_one_key():
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(3, H, D, generator=gen)
    keys = torch.randn(6, PAGE, HKV, D, generator=gen)  # 6 pages
    bound = page_attention_bound(q, keys.amin(1), keys.amax(1))  # [H, 3, 6]
    scores = torch.einsum("qhd,pkhd->hqpk", q, keys.repeat_interleave(H // HKV, 2))  # [H, 3, 6, PAGE]
    assert (bound >= scores.amax(-1) - 1e-5).all()
    assert (bound > scores.amax(-1) + 1e-3).any()  # a bound, not the score itself
    one = keys[:, :1].expand(-1, PAGE, -1, -1)  # every key of a page the same: the bound is its score
    torch.testing.assert_close(page_attention_bound(q, one.amin(1), one.amax(1)),
                               torch.einsum("qhd,phd->hqp", q, one[:, 0].repeat_interleave(H // HKV, 1)))


@pytest.mark.parametrize("seq_len, q_len", [(90, 10), (91, 37), (64, 1)])
def test_a_budget_covering_every_page_is_dense_attention(seq_len, q_len):
    gen = torch.Generator().manual_seed(seq_len)
    key, value = torch.randn(seq_len, HKV, D, generator=gen), torch.randn(seq_len, HKV, D, generator=gen)
    pool = Pool(key, value, gen)
    q = torch.randn(q_len, H, D, generator=gen)
    out = run(pool, q, seq_len, budget=100)
    want = reference(q, key, value, torch.arange(seq_len), torch.arange(seq_len - q_len, seq_len), D ** -0.5)
    torch.testing.assert_close(out.double(), want, atol=1e-5, rtol=1e-5)
    assert pool.pages_read() == list(range(-(-seq_len // PAGE)))


def test_the_chunk_reads_its_sinks_its_window_and_the_page_its_last_queries_look_for():
    """A chunk of 12 tokens after 108 of context: pages 0 (sink) and 25-29 (the window before the
    chunk and the chunk itself) always; of pages 1-24, the one holding a key planted along the
    last queries, then the others by summary."""
    gen = torch.Generator().manual_seed(4)
    seq_len, q_len, planted_page = 120, 12, 13
    key, value = 0.5 * torch.randn(seq_len, HKV, D, generator=gen), torch.randn(seq_len, HKV, D, generator=gen)
    q = torch.randn(q_len, H, D, generator=gen)
    key[planted_page * PAGE + 2] = 8 * q[-4:].reshape(4, HKV, H // HKV, D).mean((0, 2))  # what they look for
    pool = Pool(key, value, gen)
    out = run(pool, q, seq_len, budget=3, sinks=1, recent=2)
    read = pool.pages_read()
    assert read[0] == 0 and read[-5:] == [25, 26, 27, 28, 29] and len(read) == 1 + 3 + 5
    assert planted_page in read[1:4] and read[1:4] == sorted(read[1:4])
    # exactly attention over the keys read, at their positions
    positions = torch.cat([torch.arange(p * PAGE, (p + 1) * PAGE) for p in read])
    positions = positions[positions < seq_len]
    want = reference(q, key[positions], value[positions], positions, torch.arange(seq_len - q_len, seq_len),
                     D ** -0.5)
    torch.testing.assert_close(out.double(), want, atol=1e-5, rtol=1e-5)
    # closer to dense for the last queries than the same read with another page for the planted one
    dense = reference(q, key, value, torch.arange(seq_len), torch.arange(seq_len - q_len, seq_len), D ** -0.5)
    other = next(p for p in range(1, 25) if p not in read)
    swapped = torch.cat([torch.arange(p * PAGE, (p + 1) * PAGE) for p in sorted(set(read) - {planted_page} | {other})])
    swapped = swapped[swapped < seq_len]
    worse = reference(q, key[swapped], value[swapped], swapped, torch.arange(seq_len - q_len, seq_len), D ** -0.5)
    assert (out[-4:].double() - dense[-4:]).abs().max() < 0.5 * (worse[-4:] - dense[-4:]).abs().max()


def test_the_last_queries_choose_not_the_first():
    """The chunk's first half looks one way, its second half another, each with a page holding a
    key that way. With room for one page, the one the last queries look for is read."""
    gen = torch.Generator().manual_seed(6)
    seq_len, q_len = 200, 100
    key, value = 0.5 * torch.randn(seq_len, HKV, D, generator=gen), torch.randn(seq_len, HKV, D, generator=gen)
    first, last = torch.randn(2, HKV, D, generator=gen)
    q = torch.randn(q_len, H, D, generator=gen)
    q[:50] += 2 * first.repeat_interleave(H // HKV, 0)
    q[50:] += 2 * last.repeat_interleave(H // HKV, 0)
    key[5 * PAGE + 1], key[9 * PAGE + 3] = 3 * last, 3 * first
    pool = Pool(key, value, gen)
    run(pool, q, seq_len, budget=1, sinks=1, recent=1)
    assert pool.pages_read()[:2] == [0, 5]


def test_a_zero_budget_reads_only_the_sinks_and_the_window():
    gen = torch.Generator().manual_seed(5)
    key, value = torch.randn(80, HKV, D, generator=gen), torch.randn(80, HKV, D, generator=gen)
    pool = Pool(key, value, gen)
    run(pool, torch.randn(8, H, D, generator=gen), 80, budget=0, sinks=2, recent=1)
    assert pool.pages_read() == [0, 1, 17, 18, 19]
