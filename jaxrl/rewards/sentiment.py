"""Lexicon sentiment reward for the quickstart task "make the stories happier" (``tinystories/sentiment``).

Formula (graded and signed, so GRPO sees differences within a group)::

    words  = lower-cased runs of letters/apostrophes in the text
    lemma  = the first suffix-stripped candidate found in a lexicon (see :func:`lemma_candidates`)
    pos    = number of words whose lemma is in POSITIVE_WORDS
    neg    = number of words whose lemma is in NEGATIVE_WORDS
             (a sentiment word directly after a negator in NEGATORS, e.g. "not happy", counts for the
             other side)
    score  = clip((pos - neg) / SCALE, -1, 1)          with SCALE = 4

So one extra happy word moves the score by 0.25, and four net happy words saturate it at 1.0.
The word lists are the module constants below, aimed at the TinyStories vocabulary.
"""

from __future__ import annotations

import re

SCALE = 4.0

POSITIVE_WORDS = frozenset(
    """
    happy glad joy joyful smile laugh giggle grin fun funny love lovely enjoy kind nice good great
    best better wonderful beautiful pretty friend friendly play hug kiss cheer cheerful excited proud
    share help thank thankful yay hooray safe warm cozy gentle brave calm peace peaceful delight
    delighted amazing awesome cool sweet yummy tasty treat gift together win celebrate dance sing
    sunny bright shine sparkle magic special favorite laughter hope comfort care
    """.split()
)

NEGATIVE_WORDS = frozenset(
    """
    sad cry tear sob angry mad upset scared scare afraid fear frighten hurt pain sick ill bad
    lost lose broke broken break lonely alone hate mean fight hit bite scream yell shout frown
    worry worried cold hungry dark die dead ugly naughty bored grumpy ouch sore stuck trouble
    danger dangerous nervous sorrow rude wrong weak gloomy storm
    """.split()
)

NEGATORS = frozenset(
    "not no never don't didn't doesn't wasn't isn't aren't weren't can't couldn't won't nobody".split()
)

_WORD_RE = re.compile(r"[a-z']+")
# Irregular forms that suffix rules do not reach.
_IRREGULAR = {
    "cried": "cry",
    "cries": "cry",
    "crying": "cry",
    "bitten": "bite",
    "died": "die",
    "dying": "die",
    "fought": "fight",
    "won": "win",
    "shone": "shine",
    "sang": "sing",
    "sung": "sing",
    "felt": "feel",
    "tears": "tear",
    "happier": "happy",
    "happiest": "happy",
    "happily": "happy",
    "happiness": "happy",
    "sadness": "sad",
    "sadly": "sad",
    "sadder": "sad",
    "saddest": "sad",
    "angrily": "angry",
    "scarier": "scare",
    "scary": "scare",
    "worse": "bad",
    "worst": "bad",
    "loved": "love",
    "loving": "love",
    "smiling": "smile",
    "smiled": "smile",
    "sharing": "share",
    "shared": "share",
    "danced": "dance",
    "dancing": "dance",
}


def lemma_candidates(word: str) -> list[str]:
    """The word itself, an irregular-form lemma if listed, then simple suffix strips.

    Suffix rules: ``'s``; ``-ies/-ied/-ier/-iest/-ily/-iness -> -y``; ``-ness``, ``-ly``, ``-ful``,
    ``-ing``, ``-ed``, ``-er``, ``-est``, ``-es``, ``-s``, and ``-d`` only when the stem then ends in
    ``e`` (``smiled -> smile`` but not ``made -> mad``); a doubled final consonant is undone
    (``hugged -> hug``). E.g. ``played -> play``, ``friends -> friend``.
    """
    w = word[:-2] if word.endswith("'s") else word
    out = [w]
    if w in _IRREGULAR:
        out.append(_IRREGULAR[w])
    for suf, rep in (
        ("iness", "y"),
        ("iest", "y"),
        ("ies", "y"),
        ("ied", "y"),
        ("ier", "y"),
        ("ily", "y"),
    ):
        if w.endswith(suf) and len(w) > len(suf) + 1:
            out.append(w[: -len(suf)] + rep)
    for suf in ("ness", "ful", "ly", "ing", "est", "ed", "er", "es", "s", "d"):
        if w.endswith(suf) and len(w) > len(suf) + 1:
            stem = w[: -len(suf)]
            if suf == "d" and not stem.endswith("e"):
                continue
            out.append(stem)
            if len(stem) > 2 and stem[-1] == stem[-2] and stem[-1] not in "aeiouls":
                out.append(stem[:-1])  # hugged -> hugg -> hug; but "smell"/"all" keep their ll
    return out


def word_polarity(word: str) -> int:
    """+1 if the word's lemma is positive, -1 if negative, else 0 (the first lexicon hit wins)."""
    for cand in lemma_candidates(word):
        if cand in POSITIVE_WORDS:
            return 1
        if cand in NEGATIVE_WORDS:
            return -1
    return 0


def count_sentiment(text: str) -> tuple[int, int]:
    """``(pos, neg)`` word counts of ``text`` (negator-flipped; see module docstring)."""
    pos = neg = 0
    prev = ""
    for w in _WORD_RE.findall(text.lower()):
        p = word_polarity(w)
        if prev in NEGATORS:
            p = -p
        if p > 0:
            pos += 1
        elif p < 0:
            neg += 1
        prev = w
    return pos, neg


HAPPY_THRESHOLD = 0.5  # a story scoring at least this counts as "happy" (the task's accuracy, ``acc``)


def compute_score(solution_str: str) -> float:
    """Happiness of a story continuation: ``clip((pos - neg) / 4, -1, 1)``, a float in ``[-1, 1]``.

    Args:
        solution_str: the generated text (any length; empty -> 0.0).

    Returns:
        float score; see the module docstring for the formula and word lists.
    """
    pos, neg = count_sentiment(solution_str)
    return float(min(1.0, max(-1.0, (pos - neg) / SCALE)))
