"""Seeded English-looking prose for the benchmarks: passages a model can read and copy.

A passage is sentences filled from templates with words and phrases of the fixed lists below
(a few hundred in all), drawn with the caller's `numpy` generator: the same generator state
gives the same passage, and two passages of one generator differ (thousands of choices per
sentence). Sentences are grouped into paragraphs of 3 to 6, separated by a blank line.

The text is dull but real English, unlike random token ids: a model asked to repeat it really
copies it, which is what an n-gram (prompt-lookup) drafter needs to find its drafts.

Length: `passage(tokenizer, rng, num_tokens)` adds sentences until the passage, encoded
without special tokens, has at least `num_tokens` tokens, and stops at that sentence's end: it
overshoots by less than one sentence (at most ~25 tokens).
"""

from __future__ import annotations

import numpy as np

PEOPLE = (
    "miller", "teacher", "fisherman", "baker", "doctor", "sailor", "farmer", "painter",
    "carpenter", "merchant", "soldier", "poet", "gardener", "shepherd", "weaver", "blacksmith",
    "nurse", "student", "traveller", "clerk", "priest", "singer", "hunter", "potter", "judge",
    "widow", "captain", "cook", "mayor", "scholar", "musician", "tailor", "shopkeeper",
    "watchman", "librarian", "engineer", "pilot", "child", "grandmother", "neighbour",
)
PERSON_ADJECTIVES = (
    "old", "young", "tired", "cheerful", "quiet", "clever", "stubborn", "patient", "curious",
    "honest", "nervous", "proud", "gentle", "restless", "careful", "lonely", "generous",
    "serious", "famous", "humble",
)
THINGS = (
    "letter", "basket", "lantern", "boat", "map", "key", "coat", "book", "bridge", "garden",
    "window", "wagon", "bell", "box", "painting", "clock", "mirror", "table", "rope", "ladder",
    "blanket", "bottle", "candle", "chair", "fence", "gate", "hat", "knife", "ring", "shoe",
    "song", "story", "photograph", "recipe", "drum", "kettle", "violin", "umbrella", "compass",
    "notebook",
)
THING_ADJECTIVES = (
    "small", "heavy", "broken", "wooden", "red", "blue", "ancient", "strange", "shiny", "dusty",
    "narrow", "bright", "green", "silver", "forgotten", "painted", "crooked", "warm", "empty",
    "golden",
)
VERBS = (
    "carried", "painted", "found", "repaired", "sold", "borrowed", "kept", "opened", "cleaned",
    "lost", "bought", "watched", "described", "measured", "wrapped", "studied", "dropped",
    "lifted", "returned", "counted", "built", "pulled", "copied", "mended", "polished",
)
INTRANSITIVE_VERBS = (
    "walked", "waited", "slept", "sang", "laughed", "worked", "rested", "listened", "wandered",
    "stayed", "argued", "prayed", "danced", "whistled", "hurried",
)
PLACES = (
    "near the river", "at the edge of the forest", "behind the old mill", "in the village square",
    "on the top of the hill", "beside the harbour", "under the stone bridge", "in a small kitchen",
    "at the railway station", "inside the church", "across the valley", "along the muddy road",
    "by the northern gate", "in the crowded market", "on the sandy beach",
    "at the back of the library", "near the frozen lake", "in the empty theatre",
    "beneath the tall oak tree", "outside the bakery",
)
TIMES = (
    "in the morning", "late at night", "before the storm", "after the harvest",
    "on a cold Tuesday", "every spring", "during the long winter", "early one summer", "at noon",
    "when the rain stopped", "years ago", "last autumn", "just before sunrise",
    "on the first day of the fair", "later that evening",
)
REASONS = (
    "the roads were closed", "nobody else would do it", "the weather had changed",
    "it was market day", "the letter had arrived too late", "a stranger had asked for help",
    "the bells were ringing", "the river had risen", "the lamps were lit early",
    "everyone was asleep",
)
ADVERBS = (
    "slowly", "carefully", "quietly", "again", "at once", "without a word", "with great care",
    "twice",
)

TEMPLATES = (
    "{time}, the {padj} {person} {verb} the {tadj} {thing} {place}.",
    "The {padj} {person} {verb} {a_tadj} {thing} because {reason}.",
    "{a_padj} {person} {intransitive} {place} {adverb}, and the {person2} {verb} the {thing}.",
    "Nobody knew why the {person} {verb} the {tadj} {thing} {adverb}.",
    "The {thing} that the {person} {verb} was {tadj} and {tadj2}.",
    "{time}, {a_padj} {person} {intransitive} {place} while the {person2} {verb} {a_tadj} {thing}.",
    "It was the {padj} {person} who {verb} the {thing} {place}.",
    "Because {reason}, the {person} {intransitive} {place} until the {thing} was {verb}.",
)


def with_article(word: str) -> str:
    """'an old', 'a heavy', 'an honest'."""
    vowel_sound = word[0] in "aeiou" or word.startswith("hon")
    return ("an " if vowel_sound else "a ") + word


def _pick(rng: np.random.Generator, words: tuple[str, ...]) -> str:
    return words[int(rng.integers(len(words)))]


def sentence(rng: np.random.Generator) -> str:
    """One sentence from a random template, capitalized, ending with a full stop."""
    padj, tadj = _pick(rng, PERSON_ADJECTIVES), _pick(rng, THING_ADJECTIVES)
    slots = {
        "time": _pick(rng, TIMES), "padj": padj, "a_padj": with_article(padj),
        "person": _pick(rng, PEOPLE), "person2": _pick(rng, PEOPLE),
        "verb": _pick(rng, VERBS), "intransitive": _pick(rng, INTRANSITIVE_VERBS),
        "tadj": tadj, "a_tadj": with_article(tadj), "tadj2": _pick(rng, THING_ADJECTIVES),
        "thing": _pick(rng, THINGS), "place": _pick(rng, PLACES),
        "reason": _pick(rng, REASONS), "adverb": _pick(rng, ADVERBS),
    }
    text = _pick(rng, TEMPLATES).format(**slots)
    return text[0].upper() + text[1:]


def join_paragraphs(paragraphs: list[list[str]]) -> str:
    return "\n\n".join(" ".join(p) for p in paragraphs if p)


def passage(tokenizer, rng: np.random.Generator, num_tokens: int) -> str:
    """Paragraphs of sentences, at least `num_tokens` tokens long (encoded without special
    tokens), overshooting by less than one sentence.

    Sentences are counted one by one (with their leading space) and the whole text is encoded
    only once the estimate reaches the target, so a passage costs about one encode per
    sentence plus one or two of the whole."""
    paragraphs: list[list[str]] = [[]]
    paragraph_len = int(rng.integers(3, 7))
    estimate = 0
    while True:
        if len(paragraphs[-1]) == paragraph_len:
            paragraphs.append([])
            paragraph_len = int(rng.integers(3, 7))
        text = sentence(rng)
        paragraphs[-1].append(text)
        estimate += len(tokenizer.encode(" " + text, add_special_tokens=False))
        if estimate >= num_tokens:
            result = join_paragraphs(paragraphs)
            estimate = len(tokenizer.encode(result, add_special_tokens=False))
            if estimate >= num_tokens:
                return result
