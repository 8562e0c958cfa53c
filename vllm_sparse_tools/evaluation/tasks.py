"""Synthetic long-context tasks in the spirit of RULER (Hsieh et al., 2024), built from real text.

Every generator is a pure function ``task(tokenizer, text, n_tokens, seed, depth) -> Sample``:
the same arguments give the same prompt token ids. ``text`` is the haystack source (a novel, a
play, the Bible); a seeded window of it is cut to length with the model's own tokenizer, and the
task's facts ("needles") are put after sentence ends at the requested relative depths. The
prompt is a chat: the document and the question as the user's turn, then the start of the
assistant's answer (``answer_prefix``), which the model continues; the prompt ids come from the
model's chat template, so a client sends them as they are and both servers see the same tokens.

Tasks (the needle wording is this project's own):

* ``single_needle``: one "The passcode for the <key> is <number>." fact; ask for it.
* ``multi_key``: the same with three distractor facts about other keys.
* ``multi_value``: four numbers for one key; ask for all of them (score: share recalled).
* ``multi_query``: four keys with a number each; ask for all four.
* ``variable_tracking``: a chain "The variable B is set to A." starting from a number, plus a
  distractor chain from another number; ask which variables hold the first number.
* ``common_words``: a numbered list of words in which ten words recur far more often than the
  rest (no haystack: the list is the context); ask for the ten.

``depth`` (0..1) places the task's main fact: the single needle, the asked key of multi_key, the
first value or key of multi_value / multi_query, the first link of the variable chain; the other
facts go to seeded random depths. ``score`` counts the expected values in the model's output.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol, Sequence

# ---------------------------------------------------------------------------------------------
# Tokenizer access
# ---------------------------------------------------------------------------------------------


class TaskTokenizer(Protocol):
    """What the generators need from a model's tokenizer."""

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...

    def chat_ids(self, user: str, answer_prefix: str) -> list[int]:
        """Prompt ids: ``user`` as the user's turn, the assistant's turn started with
        ``answer_prefix`` and left open for the model to continue."""
        ...


class HFTokenizer:
    """A Hugging Face tokenizer folder (the converted model folders in the asset cache)."""

    def __init__(self, model_dir: str):
        from transformers import AutoTokenizer

        self.tok = AutoTokenizer.from_pretrained(str(model_dir))
        self.has_chat = bool(getattr(self.tok, "chat_template", None))

    def encode(self, text: str) -> list[int]:
        return list(self.tok.encode(text, add_special_tokens=False))

    def decode(self, ids: Sequence[int]) -> str:
        return self.tok.decode(list(ids))

    def chat_ids(self, user: str, answer_prefix: str) -> list[int]:
        if not self.has_chat:  # a base model: plain text, the answer start on its own line
            return list(self.tok.encode(f"{user}\n\n{answer_prefix}", add_special_tokens=True))
        messages = [{"role": "user", "content": user},
                    {"role": "assistant", "content": answer_prefix}]
        out = self.tok.apply_chat_template(messages, continue_final_message=True, tokenize=True)
        if isinstance(out, dict) or hasattr(out, "keys"):  # transformers 5 returns an encoding
            out = out["input_ids"]
        return list(out)


# ---------------------------------------------------------------------------------------------
# Samples and scoring
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Sample:
    task: str
    target_tokens: int
    seed: int
    depth: float
    prompt_ids: list[int]
    expected: tuple[str, ...]  # values the answer must contain
    answer_prefix: str
    max_tokens: int  # new tokens to generate: enough for every expected value
    needle_depths: tuple[float, ...] = ()  # where the facts went (share of document characters)
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def n_tokens(self) -> int:
        return len(self.prompt_ids)

    @property
    def key(self) -> str:
        return f"{self.task}/{self.target_tokens}/{self.seed}"


_NUMBER = re.compile(r"(?<!\d)\d+(?!\d)")
_WORD = re.compile(r"[a-z]+")


def score(sample: Sample, output: str) -> float:
    """Share of ``sample.expected`` found in ``output``: numbers as whole numbers (not inside
    longer ones), words and names as whole words, case-insensitive."""
    if not sample.expected:
        return 0.0
    numbers = set(_NUMBER.findall(output))
    words = set(_WORD.findall(output.lower()))
    found = sum(1 for e in sample.expected
                if (e in numbers if e.isdigit() else e.lower() in words))
    return found / len(sample.expected)


# ---------------------------------------------------------------------------------------------
# Text handling
# ---------------------------------------------------------------------------------------------

_SENTENCE_END = re.compile(r"[.!?][\"'\u201d\u2019_)\]]*(?=\s)")

# Key phrases: an adjective and a noun; enough combinations for distinct keys in one prompt.
_ADJECTIVES = ("amber", "brass", "cedar", "copper", "crimson", "dusty", "emerald", "frosty",
               "golden", "granite", "hollow", "ivory", "jade", "lunar", "marble", "misty",
               "northern", "olive", "pearl", "quiet", "rusty", "scarlet", "silver", "velvet")
_NOUNS = ("anchor", "barn", "bridge", "cabinet", "canal", "chapel", "cellar", "compass",
          "fountain", "garden", "gate", "harbor", "lantern", "ledger", "lighthouse", "locker",
          "mill", "orchard", "pavilion", "quarry", "tower", "vault", "wagon", "workshop")


def sentence_boundary(text: str, depth: float) -> int:
    """Offset just after the first sentence end at or after ``depth`` of the text's characters,
    else just after the last one before it. Depth 0 gives 0; a text without any sentence end
    gives len(text) at depth 1 and the raw character offset otherwise. A sentence end counts
    only when whitespace follows it, so the text's very last sentence end never does."""
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth must be within [0, 1], got {depth}")
    if depth <= 0.0:
        return 0
    target = int(len(text) * depth)
    m = _SENTENCE_END.search(text, target)
    if m is None:
        ends = list(_SENTENCE_END.finditer(text, 0, target))
        return ends[-1].end() if ends else (len(text) if depth >= 1.0 else target)
    return m.end()


def place(text: str, facts: Sequence[tuple[float, str]]) -> tuple[str, list[float]]:
    """Insert each (depth, sentence) after a sentence end of ``text``; facts at the same boundary
    keep their given order. Returns the document and each fact's start as a share of it."""
    at = sorted((sentence_boundary(text, d), i) for i, (d, _) in enumerate(facts))
    parts: list[str] = []
    starts = [0] * len(facts)
    prev = length = 0
    last = ""  # the document's last character so far
    for offset, i in at:
        chunk = text[prev:offset]
        if chunk:
            parts.append(chunk)
            length += len(chunk)
            last = chunk[-1]
        sep = " " if length and not last.isspace() else ""
        nxt = text[offset:offset + 1]
        piece = sep + facts[i][1] + (" " if nxt and not nxt.isspace() else "")
        starts[i] = length + len(sep)
        parts.append(piece)
        length += len(piece)
        last = piece[-1]
        prev = offset
    parts.append(text[prev:])
    doc = "".join(parts)
    return doc, [s / max(1, len(doc)) for s in starts]


def text_window(text: str, rng: random.Random, n_chars: int) -> str:
    """A seeded window of about ``n_chars`` characters starting at a line start."""
    if len(text) <= n_chars:
        return text
    start = rng.randrange(0, len(text) - n_chars)
    nl = text.find("\n", start)
    if 0 <= nl < start + 2000 and nl + 1 < len(text) - n_chars // 2:
        start = nl + 1
    return text[start:start + n_chars]


def _cut(tok: TaskTokenizer, ids: Sequence[int], n: int) -> str:
    """The first ``n`` tokens as text, ending at a whitespace when one is near the end."""
    if n <= 0:
        return ""
    cut = tok.decode(ids[:n])
    if n >= len(ids):
        return cut
    i = max(cut.rfind("\n"), cut.rfind(" "))
    return cut[:i] if i > 0 and len(cut) - i < 200 else cut


# Generated prompts end within this many tokens below the target (never above).
def length_tolerance(n_tokens: int) -> int:
    return max(16, n_tokens // 200)


def fit_haystack(tok: TaskTokenizer, source: str, n_tokens: int,
                 render: Callable[[str], tuple[list[int], Any]]) -> tuple[list[int], Any]:
    """Cut ``source`` so that ``render(haystack)`` (-> (prompt ids, extra)) is at most
    ``n_tokens`` long and within :func:`length_tolerance` of it."""
    overhead = len(render("")[0])
    budget = n_tokens - overhead
    if budget <= 0:
        raise ValueError(f"n_tokens={n_tokens} leaves no room for text (overhead {overhead})")
    ids = tok.encode(source)
    if len(ids) < budget:
        raise ValueError(f"the text window has {len(ids)} tokens, {budget} needed")
    tol = length_tolerance(n_tokens)
    best = None
    for _ in range(6):  # joins at the inserted facts move the count by a few tokens
        prompt, extra = render(_cut(tok, ids, budget))
        excess = len(prompt) - n_tokens
        if excess <= 0 and (best is None or len(prompt) > len(best[0])):
            best = (prompt, extra)
        if -tol <= excess <= 0:
            break
        # too long: drop the excess; too short: add it and half a band more (the next round trims)
        budget -= excess + (1 if excess > 0 else -tol // 2)
    if best is None:
        raise ValueError(f"could not fit a prompt into {n_tokens} tokens")
    return best


# ---------------------------------------------------------------------------------------------
# Needle tasks
# ---------------------------------------------------------------------------------------------

NEEDLE = "The passcode for the {key} is {value}."


def _keys(rng: random.Random, n: int) -> list[str]:
    """``n`` distinct key phrases with distinct nouns (so no key is a part of another)."""
    nouns = rng.sample(_NOUNS, n)
    return [f"{rng.choice(_ADJECTIVES)} {noun}" for noun in nouns]


def _numbers(rng: random.Random, n: int, digits: int = 7) -> list[str]:
    out: list[str] = []
    while len(out) < n:
        v = str(rng.randrange(10 ** (digits - 1), 10 ** digits))
        if v not in out:
            out.append(v)
    return out


def _other_depths(rng: random.Random, n: int) -> list[float]:
    return [round(rng.uniform(0.02, 0.98), 4) for _ in range(n)]


def _needle_sample(task: str, tok: TaskTokenizer, text: str, n_tokens: int, seed: int,
                   depth: float, facts: list[tuple[float, str]], question: str,
                   answer_prefix: str, expected: list[str], max_tokens: int,
                   meta: dict) -> Sample:
    rng = random.Random(f"{task}/{seed}/window")
    source = text_window(text, rng, 6 * n_tokens + 4000)

    def render(haystack: str) -> tuple[list[int], list[float]]:
        document, starts = place(haystack, facts)
        return tok.chat_ids(f"{document}\n\n{question}", answer_prefix), starts

    prompt, starts = fit_haystack(tok, source, n_tokens, render)
    return Sample(task, n_tokens, seed, depth, prompt, tuple(expected), answer_prefix, max_tokens,
                  tuple(round(s, 4) for s in starts), meta)


def single_needle(tok: TaskTokenizer, text: str, n_tokens: int, seed: int, depth: float) -> Sample:
    rng = random.Random(f"single_needle/{seed}")
    key, = _keys(rng, 1)
    value, = _numbers(rng, 1)
    return _needle_sample(
        "single_needle", tok, text, n_tokens, seed, depth,
        [(depth, NEEDLE.format(key=key, value=value))],
        f"What is the passcode for the {key}? Answer with the number only.",
        f"The passcode for the {key} is", [value], 12, {"key": key})


def multi_key(tok: TaskTokenizer, text: str, n_tokens: int, seed: int, depth: float,
              distractors: int = 3) -> Sample:
    rng = random.Random(f"multi_key/{seed}")
    keys = _keys(rng, 1 + distractors)
    values = _numbers(rng, 1 + distractors)
    depths = [depth] + _other_depths(rng, distractors)
    facts = [(d, NEEDLE.format(key=k, value=v)) for d, k, v in zip(depths, keys, values)]
    return _needle_sample(
        "multi_key", tok, text, n_tokens, seed, depth, facts,
        f"What is the passcode for the {keys[0]}? Answer with the number only.",
        f"The passcode for the {keys[0]} is", [values[0]], 12,
        {"key": keys[0], "distractor_values": values[1:]})


def multi_value(tok: TaskTokenizer, text: str, n_tokens: int, seed: int, depth: float,
                n_values: int = 4) -> Sample:
    rng = random.Random(f"multi_value/{seed}")
    key, = _keys(rng, 1)
    values = _numbers(rng, n_values)
    depths = [depth] + _other_depths(rng, n_values - 1)
    facts = [(d, NEEDLE.format(key=key, value=v)) for d, v in zip(depths, values)]
    return _needle_sample(
        "multi_value", tok, text, n_tokens, seed, depth, facts,
        f"The text gives {n_values} different passcodes for the {key}. What are they? "
        "List the numbers only.",
        f"The {n_values} passcodes for the {key} are", values, 12 * n_values, {"key": key})


def multi_query(tok: TaskTokenizer, text: str, n_tokens: int, seed: int, depth: float,
                n_queries: int = 4) -> Sample:
    rng = random.Random(f"multi_query/{seed}")
    keys = _keys(rng, n_queries)
    values = _numbers(rng, n_queries)
    depths = [depth] + _other_depths(rng, n_queries - 1)
    facts = [(d, NEEDLE.format(key=k, value=v)) for d, k, v in zip(depths, keys, values)]
    listed = ", ".join(f"the {k}" for k in keys[:-1]) + f" and the {keys[-1]}"
    return _needle_sample(
        "multi_query", tok, text, n_tokens, seed, depth, facts,
        f"What are the passcodes for {listed}? List the numbers only, in this order.",
        "The passcodes are", values, 12 * n_queries, {"keys": keys})


def _names(rng: random.Random, n: int, length: int = 5) -> list[str]:
    out: list[str] = []
    while len(out) < n:
        name = "".join(rng.choice("ABCDEFGHJKLMNPQRSTUVWXYZ") for _ in range(length))
        if name not in out:
            out.append(name)
    return out


def variable_tracking(tok: TaskTokenizer, text: str, n_tokens: int, seed: int, depth: float,
                      hops: int = 4) -> Sample:
    rng = random.Random(f"variable_tracking/{seed}")
    names = _names(rng, 2 * (hops + 1))
    chain, decoy = names[:hops + 1], names[hops + 1:]
    value, decoy_value = _numbers(rng, 2, digits=5)

    def statements(vars_: list[str], start_value: str) -> list[str]:
        first = [f"The variable {vars_[0]} is set to {start_value}."]
        return first + [f"The variable {b} is set to {a}." for a, b in zip(vars_, vars_[1:])]

    # Each chain in reading order: its links at increasing depths.
    chain_depths = [depth] + sorted(rng.uniform(depth, 1.0) for _ in range(hops))
    decoy_depths = sorted(_other_depths(rng, hops + 1))
    facts = list(zip(chain_depths, statements(chain, value)))
    facts += list(zip(decoy_depths, statements(decoy, decoy_value)))
    return _needle_sample(
        "variable_tracking", tok, text, n_tokens, seed, depth, facts,
        f"Which variables are set to {value}, directly or through other variables? "
        "List their names.",
        f"The variables set to {value} are", chain, 8 * (hops + 1),
        {"value": value, "decoy": decoy})


# ---------------------------------------------------------------------------------------------
# Common words
# ---------------------------------------------------------------------------------------------

_STOP = frozenset("""that with have this from they were been their which would there what when
your said could them into than then some these more very only over such upon also shall should
must much well even most other about after before every again never those thus here where while
""".split())


def vocabulary(text: str, min_count: int = 3) -> list[str]:
    """Distinct lower-case words of 4-9 letters that occur at least ``min_count`` times in
    ``text`` (which keeps out most fragments of hyphenated words and misspellings), common
    function words left out; in order of first appearance."""
    counts: dict[str, int] = {}
    for w in re.findall(r"(?<![a-z])[a-z]{4,9}(?![a-z])", text.lower()):
        counts[w] = counts.get(w, 0) + 1
    return [w for w, c in counts.items() if c >= min_count and w not in _STOP]


def common_words(tok: TaskTokenizer, text: str, n_tokens: int, seed: int, depth: float = 0.0,
                 n_common: int = 10, common_freq: int | None = None, rare_freq: int = 2) -> Sample:
    """The context is a numbered word list; ``depth`` is unused (the words are spread over it).
    Each common word occurs ``common_freq`` times (default: one per 256 prompt tokens, 4 to 30),
    every other word ``rare_freq`` times."""
    if common_freq is None:
        common_freq = min(30, max(4, n_tokens // 256))
    rng = random.Random(f"common_words/{seed}")
    vocab = vocabulary(text)
    words = rng.sample(vocab, len(vocab))
    common, rare_pool = words[:n_common], words[n_common:]
    question = (f"Which {n_common} words occur most often in the list above? "
                "Give only the words, separated by commas.")
    prefix = f"The {n_common} words that occur most often are:"

    def build(n_rare: int) -> list[int]:
        entries = common * common_freq + rare_pool[:n_rare] * rare_freq
        random.Random(f"common_words/{seed}/order/{n_rare}").shuffle(entries)
        listing = "\n".join(f"{i + 1}. {w}" for i, w in enumerate(entries))
        intro = "Here is a numbered list of words. Some of the words occur many times."
        return tok.chat_ids(f"{intro}\n\n{listing}\n\n{question}", prefix)

    if len(build(0)) > n_tokens:
        raise ValueError(f"n_tokens={n_tokens} is too short for {n_common}x{common_freq} words")
    lo, hi = 0, len(rare_pool)
    # A text's vocabulary fills about 64K tokens at 2 occurrences per rare word; longer lists
    # repeat the rare words more often, always well below the common words' count.
    while len(build(hi)) <= n_tokens:
        if 2 * (rare_freq + 1) > common_freq:
            raise ValueError(f"not enough distinct words in the text for {n_tokens} tokens")
        rare_freq += 1
    while hi - lo > 1:  # largest n_rare that fits
        mid = (lo + hi) // 2
        if len(build(mid)) <= n_tokens:
            lo = mid
        else:
            hi = mid
    return Sample("common_words", n_tokens, seed, depth, build(lo), tuple(common), prefix,
                  6 * n_common + 10, (), {"rare_words": lo, "common_freq": common_freq,
                                          "rare_freq": rare_freq})


TASKS: dict[str, Callable[..., Sample]] = {
    "single_needle": single_needle,
    "multi_key": multi_key,
    "multi_value": multi_value,
    "multi_query": multi_query,
    "variable_tracking": variable_tracking,
    "common_words": common_words,
}


def depths_for(n_samples: int) -> list[float]:
    """``n_samples`` needle depths spread over the prompt: the middles of equal strata."""
    return [round((i + 0.5) / n_samples, 4) for i in range(n_samples)]


def make_samples(tok: TaskTokenizer, text: str, tasks: Sequence[str], lengths: Sequence[int],
                 n_samples: int, base_seed: int = 0) -> list[Sample]:
    """``n_samples`` prompts per task and length, depths spread by :func:`depths_for`, seeds
    ``base_seed + i`` (so a prompt is the same whichever other tasks or lengths are run)."""
    out = []
    for task in tasks:
        if task not in TASKS:
            raise ValueError(f"unknown task {task!r} (known: {', '.join(TASKS)})")
        for n in lengths:
            for i, depth in enumerate(depths_for(n_samples)):
                out.append(TASKS[task](tok, text, n, base_seed + i, depth))
    return out
