"""Lexicon happiness reward: graded, signed, bounded."""

from __future__ import annotations

import pytest

from jaxrl.rewards import sentiment


@pytest.mark.parametrize(
    "text,pos,neg",
    [
        ("Lily was happy. She smiled and played with her friends.", 4, 0),
        ("Tom cried. He was sad and scared.", 0, 3),
        ("He made a cake and sat on the mat.", 0, 0),  # "made" is not "mad"
        ("They hugged and laughed happily.", 3, 0),
        ("She was not happy.", 0, 1),  # negated
        ("Ben was not sad anymore.", 1, 0),
        ("The kindness of friends", 2, 0),
        ("He lost his ball and broke his toy.", 0, 2),
    ],
)
def test_counts(text, pos, neg):
    assert sentiment.count_sentiment(text) == (pos, neg)


def test_graded_signed_and_clipped():
    texts = [
        "The dog sat.",
        "The dog was happy.",
        "The dog was happy and played.",
        "The dog was happy and played with a friend.",
    ]
    scores = [sentiment.compute_score(t) for t in texts]
    assert scores == [0.0, 0.25, 0.5, 0.75]  # (pos - neg) / 4
    assert sentiment.compute_score("sad sad sad sad sad sad") == -1.0
    assert sentiment.compute_score("happy " * 20) == 1.0
    assert sentiment.compute_score("She was sad, then happy and glad.") == 0.25
    assert sentiment.compute_score("") == 0.0
    assert isinstance(sentiment.compute_score("happy"), float)


def test_word_lists_disjoint():
    assert not sentiment.POSITIVE_WORDS & sentiment.NEGATIVE_WORDS
