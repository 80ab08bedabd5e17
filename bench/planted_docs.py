"""Planted documents for measuring the preparation's filters (bench/data_filters.py, and the filters' tests): clean
prose from Python's own documentation, and what each filter exists to catch made from it, or its hard negatives.

    paragraphs()     Python's documentation in paragraphs of 40 words or more, shuffled (technical prose)
    salad            the words of a text in random order (perplexity's target)
    gibberish        random letters in words of a text's count (perplexity's target)
    spam             web boilerplate: navigation, calls to buy, cookie banners (the quality classifier's target)
    OFFENSIVE        insults, to hide in a long benign document (toxicity's target)
    TECHNICAL        systems programming's violent verbs (toxicity's hard negatives)
    with_fillers     a text with filler words inserted between its words (a paraphrase MinHash misses)
    reordered        a text with its sentences in another order (another)
"""

from __future__ import annotations

import random
import re

from glm46.data.documents import Ledger
from glm46.data.embedded import python_docs

OFFENSIVE = ["You are a stupid idiot and everyone hates you.", "Shut up, you worthless piece of garbage."]
TECHNICAL = [
    "To stop it, kill the process and abort the child before the parent exits.",
    "Terminate the worker thread, then kill -9 the daemon if it hangs.",
    "The executor shoots down every task and reaps the zombie processes.",
]
SPAM = [
    "Click here to buy now!",
    "Best price guaranteed, free shipping on all orders over $49.",
    "Subscribe to our newsletter for exclusive deals and coupons.",
    "Home | About Us | Products | Contact | Login | Register",
    "We use cookies to improve your experience. Accept all cookies.",
    "Limited time offer: 70% off today only, hurry while stocks last!",
    "Copyright 2024 All rights reserved. Privacy Policy | Terms of Service",
    "Sign up now and get a $10 gift card with your first purchase.",
    "Top 10 cheap deals you will not believe, number 7 will shock you.",
    "Share on Facebook Tweet Pin it Email Print",
    "Customers who bought this item also bought these products.",
    "Call now toll free, our agents are standing by 24/7.",
]
FILLERS = ["basically", "actually", "really", "simply", "indeed", "of course", "in fact", "clearly", "just", "quite"]


def paragraphs() -> list[str]:
    found = [p for doc in python_docs(Ledger()) for p in doc.text.split("\n\n") if len(p.split()) >= 40]
    found = list(dict.fromkeys(found))  # topics repeat paragraphs
    random.Random(0).shuffle(found)
    return found


def salad(text: str, rng: random.Random) -> str:
    words = text.split()
    rng.shuffle(words)
    return " ".join(words)


def gibberish(text: str, rng: random.Random) -> str:
    return " ".join("".join(rng.choices("abcdefghijklmnopqrstuvwxyz", k=rng.randint(2, 9))) for _ in text.split())


def spam(rng: random.Random, sentences: int = 8) -> str:
    return "\n".join(rng.sample(SPAM, sentences))


def with_fillers(text: str, rng: random.Random, every: int = 4) -> str:
    """A filler word after about every `every` words: most word 5-grams change, the meaning does not."""
    words = text.split()
    for at in range(len(words) - 1, 0, -every):
        words.insert(at, rng.choice(FILLERS))
    return " ".join(words)


def reordered(text: str, rng: random.Random) -> str:
    sentences = re.split(r"(?<=[.!?])\s+", " ".join(text.split()))
    rng.shuffle(sentences)
    return " ".join(sentences)
