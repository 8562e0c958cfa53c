"""Task families of the paired benchmark (``benchmarks/paired.py``), with a held-out split.

Built on the generators' machinery in :mod:`.tasks` (text windows, facts placed after sentence
ends, prompts cut to a token length with the model's chat template) and returning its
:class:`~.tasks.Sample`, with ``task`` the family and ``meta`` naming the text, the template, the
split and the values whose presence in an answer makes it a miss (``forbidden``).

Families:

* ``distractor``: three to five facts of one form ("The special code of the <adjective> <noun>
  is <7 digits>."); the question asks for one. Half the distractor keys share the asked key's
  adjective. A hit names the asked value and none of the others.
* ``multi_value``: four values for one key; a hit names all four.
* ``multi_query``: three keys asked at once; a hit names all three values.
* ``variable_tracking``: a chain of assignments from a number and a decoy chain from another; a
  hit names every variable of the chain and none of the decoy's.
* ``passage``: a short made-up paragraph with several facts of one kind (who sold how many
  baskets) inserted in the haystack, and a question only a reading of all of it answers (who sold
  the most); a hit names that person and nobody else from the paragraph.

The split: each family's templates (the wording of its facts, question and answer start) and the
haystack texts are divided into ``tune`` and ``heldout``. Tuning choices are made on ``tune``;
``heldout`` prompts use only texts and templates that ``tune`` never uses, so a result there says
whether a choice generalises beyond the wordings it was tuned on.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass
from typing import Sequence

from .tasks import (_ADJECTIVES, _NOUNS, Sample, TaskTokenizer, _names, _numbers, _other_depths,
                    depths_for, fit_haystack, place, text_window)

SPLITS = ("tune", "heldout")
# Haystack texts by split (names as given to --text NAME=PATH).
TEXT_SPLITS: dict[str, str] = {"austen": "tune", "shakespeare": "tune", "bible": "heldout",
                               "gcide": "heldout"}


@dataclass(frozen=True)
class Template:
    """One wording of a family. ``fact`` has the family's fields ({key}, {value}, ...);
    ``question`` and ``answer`` (the start of the assistant's turn) the asked ones."""
    name: str
    split: str
    fact: str
    question: str
    answer: str


T = Template
TEMPLATES: dict[str, tuple[Template, ...]] = {
    "distractor": (
        T("code", "tune", "The special code of the {key} is {value}.",
          "What is the special code of the {key}? Answer with the number only.",
          "The special code of the {key} is"),
        T("access", "tune", "The {key} has the access number {value}.",
          "Which access number does the {key} have? Answer with the number only.",
          "The access number of the {key} is"),
        T("figure", "heldout", "Remember that the secret figure for the {key} is {value}.",
          "What is the secret figure for the {key}? Give the number only.",
          "The secret figure for the {key} is"),
        T("filed", "heldout", "Records show the {key} filed under entry {value}.",
          "Under which entry is the {key} filed? Give the number only.",
          "The {key} is filed under entry"),
    ),
    "multi_value": (
        T("code", "tune", "One of the special codes of the {key} is {value}.",
          "The text gives {n} special codes for the {key}. What are they? List the numbers only.",
          "The {n} special codes of the {key} are"),
        T("serial", "tune", "A serial number stamped on the {key} reads {value}.",
          "The text mentions {n} serial numbers stamped on the {key}. List them, numbers only.",
          "The {n} serial numbers on the {key} are"),
        T("ticket", "heldout", "Ticket {value} was issued for the {key}.",
          "{n} tickets were issued for the {key}. Which ticket numbers? Numbers only.",
          "The {n} ticket numbers for the {key} are"),
    ),
    "multi_query": (
        T("code", "tune", "The special code of the {key} is {value}.",
          "What are the special codes of {keys}? List the numbers only, in this order.",
          "The special codes are"),
        T("weight", "tune", "The {key} weighs {value} grams.",
          "How many grams do {keys} weigh? List the numbers only, in this order.",
          "Their weights in grams are"),
        T("room", "heldout", "The {key} is kept in room {value}.",
          "In which rooms are {keys} kept? List the room numbers only, in this order.",
          "The room numbers are"),
    ),
    "variable_tracking": (
        T("set", "tune", "The variable {b} is set to {a}.",
          "Which variables are set to {value}, directly or through other variables? List their names.",
          "The variables set to {value} are"),
        T("copy", "tune", "Let {b} take the value of {a}.",
          "Which names end up holding {value}, directly or by copying? List the names.",
          "The names holding {value} are"),
        T("assign", "heldout", "Assign {a} to {b}.",
          "After these assignments, which names hold {value}? List them.",
          "The names that hold {value} are"),
    ),
    "passage": (
        T("baskets", "tune",
          "At the {place} market last spring, {facts}. Nobody else sold baskets that day.",
          "According to the account of the {place} market, who sold the most baskets? Answer with "
          "the name only.", "The person who sold the most baskets was"),
        T("laps", "tune",
          "In the {place} rowing trial, {facts}. The trial had no other rowers.",
          "In the {place} rowing trial, who rowed the fewest laps? Answer with the name only.",
          "The rower with the fewest laps was"),
        T("crates", "heldout",
          "The {place} orchard keeps a harvest book: {facts}. No one else picked that year.",
          "Who picked the most crates in the {place} orchard's harvest book? The name only.",
          "The picker with the most crates was"),
    ),
}
# How one person's fact reads inside a passage template (the same index as TEMPLATES["passage"]).
PASSAGE_ITEMS = {"baskets": "{name} sold {count} baskets", "laps": "{name} rowed {count} laps",
                 "crates": "{name} picked {count} crates"}
PASSAGE_PLACES = ("Elmsworth", "Harrowgate", "Kestle", "Marrow Hill", "Pellbrook", "Thornby")
# Share of the prompts per length: distractor needles (the loss issue 53 saw) get half.
FAMILY_WEIGHTS = {"distractor": 4, "multi_value": 1, "multi_query": 1, "variable_tracking": 1,
                  "passage": 1}
FAMILIES = tuple(FAMILY_WEIGHTS)


def templates(family: str, split: str) -> tuple[Template, ...]:
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    return tuple(t for t in TEMPLATES[family] if t.split == split)


def template(family: str, name: str) -> Template:
    return next(t for t in TEMPLATES[family] if t.name == name)


def split_texts(names: Sequence[str], split: str) -> list[str]:
    """The texts of ``names`` that belong to ``split``; an unknown name is an error."""
    unknown = [n for n in names if n not in TEXT_SPLITS]
    if unknown:
        raise ValueError(f"text {unknown[0]!r} has no split; known texts: {', '.join(TEXT_SPLITS)}")
    return [n for n in names if TEXT_SPLITS[n] == split]


# ---------------------------------------------------------------------------------------------
# What to build: one spec per prompt
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class PromptSpec:
    family: str
    template: str
    text: str
    length: int  # target tokens
    seed: int
    depth: float

    @property
    def key(self) -> str:
        return f"{self.family}/{self.length}/{self.seed}"


def family_counts(n_prompts: int, families: Sequence[str] = FAMILIES) -> dict[str, int]:
    """``n_prompts`` shared by :data:`FAMILY_WEIGHTS` (largest remainders; the first families
    get the leftovers)."""
    total = sum(FAMILY_WEIGHTS[f] for f in families)
    counts = {f: n_prompts * FAMILY_WEIGHTS[f] // total for f in families}
    for f in list(families)[: n_prompts - sum(counts.values())]:
        counts[f] += 1
    return counts


def plan(split: str, text_names: Sequence[str], lengths: Sequence[int], n_prompts: int,
         families: Sequence[str] = FAMILIES, base_seed: int = 0) -> list[PromptSpec]:
    """Per length, ``n_prompts`` specs over ``families`` (:func:`family_counts`); within a
    family and length, depths spread by :func:`~.tasks.depths_for`, seeds ``base_seed + i``, the
    split's texts and templates in turn (every text with every template)."""
    texts = split_texts(text_names, split)
    if not texts:
        raise ValueError(f"no text of split {split!r} among {list(text_names)} (its texts: "
                         + ", ".join(n for n, s in TEXT_SPLITS.items() if s == split) + ")")
    out = []
    for family, count in family_counts(n_prompts, families).items():
        temps = templates(family, split)
        for length in lengths:
            for i, depth in enumerate(depths_for(count) if count else []):
                out.append(PromptSpec(family, temps[(i // len(texts)) % len(temps)].name,
                                      texts[i % len(texts)], length, base_seed + i, depth))
    return out


# ---------------------------------------------------------------------------------------------
# Generators
# ---------------------------------------------------------------------------------------------

def _keys_sharing(rng: random.Random, n: int) -> list[str]:
    """``n`` distinct "<adjective> <noun>" keys with distinct nouns; about half of the others
    share the first key's adjective, so that only the noun tells them apart."""
    nouns = rng.sample(_NOUNS, n)
    first = rng.choice(_ADJECTIVES)
    others = [a for a in _ADJECTIVES if a != first]
    return [f"{first if i == 0 or i % 2 else rng.choice(others)} {noun}" for i, noun in enumerate(nouns)]


def _build(spec: PromptSpec, tok: TaskTokenizer, text: str, facts: list[tuple[float, str]],
           question: str, answer: str, expected: Sequence[str], forbidden: Sequence[str],
           max_tokens: int, extra: dict) -> Sample:
    rng = random.Random(f"{spec.family}/{spec.seed}/{spec.text}/window")
    source = text_window(text, rng, 6 * spec.length + 4000)

    def render(haystack: str) -> tuple[list[int], list[float]]:
        document, starts = place(haystack, facts)
        return tok.chat_ids(f"{document}\n\n{question}", answer), starts

    prompt, starts = fit_haystack(tok, source, spec.length, render)
    meta = {"text": spec.text, "template": spec.template, "split": template(spec.family, spec.template).split,
            "forbidden": list(forbidden), "facts": [f for _, f in facts], **extra}
    return Sample(spec.family, spec.length, spec.seed, spec.depth, prompt, tuple(expected), answer,
                  max_tokens, tuple(round(s, 4) for s in starts), meta)


def distractor(spec: PromptSpec, tok: TaskTokenizer, text: str) -> Sample:
    rng = random.Random(f"distractor/{spec.seed}/{spec.template}")
    t = template("distractor", spec.template)
    n = rng.choice((3, 4, 5))
    keys, values = _keys_sharing(rng, n), _numbers(rng, n)
    depths = [spec.depth] + _other_depths(rng, n - 1)
    facts = [(d, t.fact.format(key=k, value=v)) for d, k, v in zip(depths, keys, values)]
    return _build(spec, tok, text, facts, t.question.format(key=keys[0]), t.answer.format(key=keys[0]),
                  [values[0]], values[1:], 16, {"key": keys[0], "keys": keys})


def multi_value(spec: PromptSpec, tok: TaskTokenizer, text: str, n_values: int = 4) -> Sample:
    rng = random.Random(f"multi_value/{spec.seed}/{spec.template}")
    t = template("multi_value", spec.template)
    key = f"{rng.choice(_ADJECTIVES)} {rng.choice(_NOUNS)}"
    values = _numbers(rng, n_values)
    depths = [spec.depth] + _other_depths(rng, n_values - 1)
    facts = [(d, t.fact.format(key=key, value=v)) for d, v in zip(depths, values)]
    return _build(spec, tok, text, facts, t.question.format(key=key, n=n_values),
                  t.answer.format(key=key, n=n_values), values, [], 12 * n_values, {"key": key})


def multi_query(spec: PromptSpec, tok: TaskTokenizer, text: str, n_queries: int = 3) -> Sample:
    rng = random.Random(f"multi_query/{spec.seed}/{spec.template}")
    t = template("multi_query", spec.template)
    keys = [f"{a} {n}" for a, n in zip(rng.sample(_ADJECTIVES, n_queries), rng.sample(_NOUNS, n_queries))]
    values = _numbers(rng, n_queries)
    depths = [spec.depth] + _other_depths(rng, n_queries - 1)
    facts = [(d, t.fact.format(key=k, value=v)) for d, k, v in zip(depths, keys, values)]
    listed = ", ".join(f"the {k}" for k in keys[:-1]) + f" and the {keys[-1]}"
    return _build(spec, tok, text, facts, t.question.format(keys=listed), t.answer, values, [],
                  12 * n_queries, {"keys": keys})


def variable_tracking(spec: PromptSpec, tok: TaskTokenizer, text: str, hops: int = 3) -> Sample:
    rng = random.Random(f"variable_tracking/{spec.seed}/{spec.template}")
    t = template("variable_tracking", spec.template)
    names = _names(rng, 2 * (hops + 1))
    chain, decoy = names[:hops + 1], names[hops + 1:]
    value, decoy_value = _numbers(rng, 2, digits=5)

    def links(vars_: list[str], start: str) -> list[str]:
        return [t.fact.format(a=a, b=b) for a, b in zip([start, *vars_], vars_)]

    # A chain's links in reading order, so that it can be followed from its start.
    chain_depths = [spec.depth] + sorted(rng.uniform(spec.depth, 1.0) for _ in range(hops))
    facts = list(zip(chain_depths, links(chain, value)))
    facts += list(zip(sorted(_other_depths(rng, hops + 1)), links(decoy, decoy_value)))
    return _build(spec, tok, text, facts, t.question.format(value=value), t.answer.format(value=value),
                  chain, decoy, 8 * (hops + 1), {"value": value})


def passage(spec: PromptSpec, tok: TaskTokenizer, text: str, people: int = 5) -> Sample:
    rng = random.Random(f"passage/{spec.seed}/{spec.template}")
    t = template("passage", spec.template)
    names = _person_names(rng, people)
    counts = rng.sample(range(3, 40), people)
    # The answer is the extreme the question asks for; it must not be first or last in the
    # paragraph, where a reader skimming one end would find it.
    pick = max if spec.template in ("baskets", "crates") else min
    target = counts.index(pick(counts))
    middle = rng.randrange(1, people - 1)
    counts[target], counts[middle] = counts[middle], counts[target]
    items = [PASSAGE_ITEMS[spec.template].format(name=n, count=c) for n, c in zip(names, counts)]
    place_name = rng.choice(PASSAGE_PLACES)
    paragraph = t.fact.format(place=place_name, facts=", ".join(items[:-1]) + " and " + items[-1])
    return _build(spec, tok, text, [(spec.depth, paragraph)], t.question.format(place=place_name),
                  t.answer, [names[middle]], [n for i, n in enumerate(names) if i != middle], 12,
                  {"people": names, "counts": counts})


def _person_names(rng: random.Random, n: int) -> list[str]:
    """``n`` distinct made-up given names of three consonant-vowel syllables (Tamelo, Virosa):
    pronounceable, so they tokenize like names, and found in no text."""
    out: list[str] = []
    while len(out) < n:
        name = "".join(rng.choice("bdfklmnprstvz") + rng.choice("aeiou") for _ in range(3)).capitalize()
        if name not in out:
            out.append(name)
    return out


GENERATORS = {"distractor": distractor, "multi_value": multi_value, "multi_query": multi_query,
              "variable_tracking": variable_tracking, "passage": passage}


def build(spec: PromptSpec, tok: TaskTokenizer, text: str) -> Sample:
    return GENERATORS[spec.family](spec, tok, text)


# ---------------------------------------------------------------------------------------------
# Scoring
# ---------------------------------------------------------------------------------------------

_NUMBER = re.compile(r"(?<!\d)\d+(?!\d)")
_WORD = re.compile(r"[a-z]+")


def _found(value: str, numbers: set[str], words: set[str]) -> bool:
    return value in numbers if value.isdigit() else value.lower() in words


def hit(sample: Sample, output: str) -> bool:
    """Every expected value in ``output`` and none of the forbidden ones (numbers as whole
    numbers, names as whole words, case-insensitive)."""
    numbers = set(_NUMBER.findall(output))
    words = set(_WORD.findall(output.lower()))
    return (all(_found(e, numbers, words) for e in sample.expected)
            and not any(_found(f, numbers, words) for f in sample.meta.get("forbidden", ())))


def normalize(output: str) -> str:
    """An answer as compared between variants: lower case, letters and digits, single spaces
    (a changed answer is one whose words or numbers changed, not its spacing or punctuation)."""
    return " ".join(re.findall(r"[a-z0-9]+", output.lower()))
