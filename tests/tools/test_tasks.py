"""The synthetic task generators: facts really in the prompt, at the requested depth, lengths
within tolerance, determinism, scoring. A sub-word fake tokenizer keeps these tests offline; one
test repeats the length and placement checks with SmolLM2's real tokenizer when it is cached."""

from __future__ import annotations

import re

import pytest

from vllm_sparse_tools import assets
from vllm_sparse_tools.evaluation import tasks as T

# Text: numbered sentences on short lines, so every position is identifiable, with 2000
# made-up words (8 letters, each used 18 times) for the common-words vocabulary.
_SYL = ("ba", "ko", "ri", "su", "te", "lo", "mi", "na", "pe", "du")
WORDS = [_SYL[i // 1000 % 10] + _SYL[i // 100 % 10] + _SYL[i // 10 % 10] + _SYL[i % 10]
         for i in range(2000)]
TEXT = "\n".join(" ".join(f"Sentence {i}.{j} tells of the {WORDS[(6 * i + 2 * j) % 2000]} and "
                          f"of the {WORDS[(6 * i + 2 * j + 1) % 2000]}." for j in range(3))
                 for i in range(6000))


class PieceTokenizer:
    """Sub-word tokens: each run of non-space characters is cut into pieces of at most three
    characters, the first carrying the preceding whitespace (so numbers span several tokens).
    decode(encode(x)) == x. The chat wrapper adds three marker tokens around the turns."""

    MARKERS = ("<user>", "</user><assistant>", "</prompt>")

    def __init__(self):
        self.vocab: list[str] = list(self.MARKERS)
        self.ids = {m: i for i, m in enumerate(self.MARKERS)}

    def _id(self, piece):
        if piece not in self.ids:
            self.ids[piece] = len(self.vocab)
            self.vocab.append(piece)
        return self.ids[piece]

    def encode(self, text):
        out = []
        for m in re.finditer(r"(\s*)(\S+)|\s+$", text):
            space, word = m.group(1) or "", m.group(2)
            if word is None:
                out.append(self._id(m.group(0)))
                continue
            pieces = [word[i:i + 3] for i in range(0, len(word), 3)]
            pieces[0] = space + pieces[0]
            out += [self._id(p) for p in pieces]
        return out

    def decode(self, ids):
        return "".join(self.vocab[i] for i in ids)

    def chat_ids(self, user, answer_prefix):
        return [0] + self.encode(user) + [1] + self.encode(answer_prefix)


@pytest.fixture(scope="module")
def tok():
    return PieceTokenizer()


def _user_and_prefix(tok, sample):
    text = tok.decode(sample.prompt_ids)
    assert text.startswith("<user>") and text.count("</user><assistant>") == 1
    user, prefix = text[len("<user>"):].split("</user><assistant>")
    return user, prefix


NEEDLE_TASKS = ["single_needle", "multi_key", "multi_value", "multi_query", "variable_tracking"]


@pytest.mark.parametrize("task", list(T.TASKS))
@pytest.mark.parametrize("n_tokens", [700, 3000])
def test_length_within_tolerance_and_deterministic(tok, task, n_tokens):
    a = T.TASKS[task](tok, TEXT, n_tokens, 5, 0.4)
    b = T.TASKS[task](tok, TEXT, n_tokens, 5, 0.4)
    assert a == b
    assert n_tokens - T.length_tolerance(n_tokens) <= a.n_tokens <= n_tokens
    assert a.target_tokens == n_tokens and a.task == task
    c = T.TASKS[task](tok, TEXT, n_tokens, 6, 0.4)
    assert c.prompt_ids != a.prompt_ids and c.expected != a.expected


@pytest.mark.parametrize("task", NEEDLE_TASKS)
@pytest.mark.parametrize("depth", [0.0, 0.25, 0.5, 0.9, 1.0])
def test_facts_are_in_the_document_at_their_depths(tok, task, depth):
    s = T.TASKS[task](tok, TEXT, 2500, 1, depth)
    user, prefix = _user_and_prefix(tok, s)
    assert prefix == s.answer_prefix
    document, question = user.rsplit("\n\n", 1)
    assert "?" in question
    for value in s.expected:
        assert value in document
    if task != "multi_query":  # multi_query names its keys in the question
        for value in s.expected:
            assert value not in question and value not in prefix
    # the main fact starts where the sample says, near the requested depth
    main = document.index(s.expected[0] if task != "variable_tracking" else
                          f"The variable {s.expected[0]} is set to")
    if task in ("single_needle", "multi_key", "multi_value", "multi_query"):
        main = document.rindex("The passcode", 0, main + 1)
    assert abs(main / len(document) - s.needle_depths[0]) < 0.002
    assert abs(s.needle_depths[0] - depth) < 0.03
    # facts follow a sentence end (or open the document)
    assert main == 0 or document[:main].rstrip()[-1] in ".!?"


def test_single_needle_once_and_its_question(tok):
    s = T.single_needle(tok, TEXT, 2000, 3, 0.5)
    user, prefix = _user_and_prefix(tok, s)
    value, = s.expected
    assert user.count(value) == 1 and re.fullmatch(r"\d{7}", value)
    assert f"The passcode for the {s.meta['key']} is {value}." in user
    assert prefix == f"The passcode for the {s.meta['key']} is"
    assert user.endswith(f"What is the passcode for the {s.meta['key']}? Answer with the number only.")


def test_multi_key_distractors_use_other_keys(tok):
    s = T.multi_key(tok, TEXT, 2000, 3, 0.5)
    user, _ = _user_and_prefix(tok, s)
    keys = re.findall(r"The passcode for the (\w+ \w+) is (\d+)\.", user)
    assert len(keys) == 4 and len({k for k, _ in keys}) == 4
    assert (s.meta["key"], s.expected[0]) in keys
    assert sorted(v for _, v in keys if v != s.expected[0]) == sorted(s.meta["distractor_values"])
    nouns = [k.split()[1] for k, _ in keys]
    assert len(set(nouns)) == 4  # no key phrase contains another's noun


def test_multi_value_and_multi_query(tok):
    mv = T.multi_value(tok, TEXT, 2000, 3, 0.3)
    user, _ = _user_and_prefix(tok, mv)
    found = re.findall(rf"The passcode for the {mv.meta['key']} is (\d+)\.", user)
    assert sorted(found) == sorted(mv.expected) and len(set(found)) == 4
    mq = T.multi_query(tok, TEXT, 2000, 3, 0.3)
    user, _ = _user_and_prefix(tok, mq)
    for key, value in zip(mq.meta["keys"], mq.expected):
        assert f"The passcode for the {key} is {value}." in user
        assert f"the {key}" in user.rsplit("\n\n", 1)[1]


def test_variable_tracking_chain_in_reading_order(tok):
    s = T.variable_tracking(tok, TEXT, 3000, 2, 0.2)
    user, prefix = _user_and_prefix(tok, s)
    value = s.meta["value"]
    chain = list(s.expected)
    positions = [user.index(f"The variable {chain[0]} is set to {value}.")]
    positions += [user.index(f"The variable {b} is set to {a}.") for a, b in zip(chain, chain[1:])]
    assert positions == sorted(positions)
    assert value in prefix and not set(chain) & set(s.meta["decoy"])
    for name in s.meta["decoy"]:
        assert f"The variable {name} is set to" in user


def test_common_words_frequencies(tok):
    s = T.common_words(tok, TEXT, 2500, 4)
    user, _ = _user_and_prefix(tok, s)
    listed = re.findall(r"^\d+\. (\S+)$", user, re.M)
    counts = {w: listed.count(w) for w in set(listed)}
    assert all(counts[w] == s.meta["common_freq"] for w in s.expected)
    others = [c for w, c in counts.items() if w not in s.expected]
    assert others and all(c == s.meta["rare_freq"] for c in others)
    assert len(s.expected) == 10 and len(set(s.expected)) == 10
    # numbered 1..N without gaps
    numbers = [int(x) for x in re.findall(r"^(\d+)\. ", user, re.M)]
    assert numbers == list(range(1, len(numbers) + 1))


def test_vocabulary_keeps_repeated_whole_words():
    text = "Apple apple APPLE banana banana. kiwi kiwi kiwi grapefruits grapefruits grapefruits " \
           "that that that pre-ised ised"
    # banana twice; grapefruits too long; "that" a function word; "ised" twice (once after "pre-")
    assert T.vocabulary(text) == ["apple", "kiwi"]


def test_place_and_sentence_boundary():
    text = "One two. Three four! Five six? Seven."
    assert T.sentence_boundary(text, 0.0) == 0
    assert text[:T.sentence_boundary(text, 0.3)] == "One two. Three four!"
    assert text[:T.sentence_boundary(text, 1.0)] == "One two. Three four! Five six?"
    doc, starts = T.place(text, [(0.5, "B."), (0.0, "A."), (0.5, "C.")])
    assert doc == "A. One two. Three four! B. C. Five six? Seven."
    assert [doc[round(s * len(doc)):][:2] for s in starts] == ["B.", "A.", "C."]
    with pytest.raises(ValueError):
        T.sentence_boundary(text, 1.5)


def test_score():
    s = T.Sample("multi_value", 100, 0, 0.5, [1], ("1234567", "7654321"), "p", 10)
    assert T.score(s, " 1234567 and 7654321.") == 1.0
    assert T.score(s, " 1234567, 76543210") == 0.5  # inside a longer number does not count
    assert T.score(s, "nothing") == 0.0
    w = T.Sample("common_words", 100, 0, 0.5, [1], ("walk", "home"), "p", 10)
    assert T.score(w, "Walk, homely, HOME") == 1.0
    assert T.score(w, "walked") == 0.0


def test_make_samples_spreads_depths_and_seeds(tok):
    samples = T.make_samples(tok, TEXT, ["single_needle", "multi_key"], [600, 900], 3, base_seed=10)
    assert len(samples) == 12
    assert [s.depth for s in samples[:3]] == [0.1667, 0.5, 0.8333]
    assert [s.seed for s in samples[:3]] == [10, 11, 12]
    # a prompt does not depend on which other tasks or lengths are generated with it
    alone = T.make_samples(tok, TEXT, ["multi_key"], [900], 3, base_seed=10)
    assert alone == samples[-3:]
    with pytest.raises(ValueError, match="unknown task"):
        T.make_samples(tok, TEXT, ["nope"], [600], 1)
    with pytest.raises(ValueError, match="no room"):
        T.single_needle(tok, TEXT, 20, 0, 0.5)


SMOLLM2 = assets.cache_root() / assets.SMOLLM2_DIR


@pytest.mark.skipif(not (SMOLLM2 / "tokenizer.json").exists(), reason="SmolLM2 not in the cache")
@pytest.mark.parametrize("task", list(T.TASKS))
def test_real_tokenizer_lengths_and_needles(task):
    tok = T.HFTokenizer(str(SMOLLM2))
    s = T.TASKS[task](tok, TEXT, 4000, 0, 0.7)
    assert 4000 - T.length_tolerance(4000) <= s.n_tokens <= 4000
    text = tok.decode(s.prompt_ids)
    assert text.endswith(s.answer_prefix)
    assert all(v in text for v in s.expected)
    assert tok.chat_ids("x", "y") != tok.encode("x y")  # the chat template is applied
