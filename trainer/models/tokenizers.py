"""CLIP tokenizers built locally and deterministically (no hub): the embedded model's and the test models'."""

from __future__ import annotations

from pathlib import Path

_CORPUS = [
    "a handwritten digit {d}",
    "a photo of the number {d}",
    "the digit {d} written by hand",
    "a picture of a cat and a dog",
    "a black and white image of a number",
    "an image",
    "text on a sign",
]
_DIGIT_WORDS = "zero one two three four five six seven eight nine".split()


def _bpe(symbols: list[str], ranks: dict[tuple[str, str], int]) -> list[str]:
    """CLIP's BPE on one word: repeatedly join every occurrence of the lowest-ranked adjacent pair."""
    while len(symbols) > 1:
        pairs = [(ranks[p], p) for p in zip(symbols, symbols[1:], strict=False) if p in ranks]
        if not pairs:
            break
        first, second = min(pairs)[1]
        out, i = [], 0
        while i < len(symbols):
            if i + 1 < len(symbols) and (symbols[i], symbols[i + 1]) == (first, second):
                out.append(first + second)
                i += 2
            else:
                out.append(symbols[i])
                i += 1
        symbols = out
    return symbols


def clip_bpe_tokenizer(directory: Path, max_length: int) -> None:
    """A BPE in which every word of the corpus is one token, saved as a CLIPTokenizer. Built by hand rather
    than trained: the ``tokenizers`` trainer numbers symbols and orders equal-count merges in hash order,
    which differs between processes, so two builds would give two models. Words are taken in sorted order;
    each gets merges of its leftmost pair until it is one token (a new merge ranks after all earlier ones,
    so it never splits an earlier word). CLIP's BPE marks word ends with "</w>"."""
    from transformers import CLIPTokenizer

    special = ["<|startoftext|>", "<|endoftext|>"]
    texts = [t.format(d=d) for t in _CORPUS for d in list("0123456789") + _DIGIT_WORDS]
    words = sorted({w for text in texts for w in text.lower().split()})
    chars = sorted({c for w in words for c in w})
    ranks: dict[tuple[str, str], int] = {}
    for word in words:
        symbols = _bpe(list(word[:-1]) + [word[-1] + "</w>"], ranks)
        while len(symbols) > 1:
            ranks[(symbols[0], symbols[1])] = len(ranks)
            symbols = _bpe(symbols, ranks)
    merged = [a + b for a, b in ranks]
    vocab = {t: i for i, t in enumerate(dict.fromkeys(special + chars + [c + "</w>" for c in chars] + merged))}
    tok = CLIPTokenizer(vocab=vocab, merges=list(ranks), model_max_length=max_length)
    tok.save_pretrained(directory)


def t5_word_tokenizer(directory: Path, words: list[str], max_length: int) -> None:
    """A unigram T5 tokenizer (what Wan's UMT5 reads) whose pieces are ``words`` whole and single characters for
    anything else, saved with ``save_pretrained``: deterministic, no hub and no sentencepiece model file."""
    from transformers import T5Tokenizer

    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("▁", -1.0)]
    pieces += [("▁" + w, -2.0) for w in sorted(set(words))]
    pieces += [(c, -3.0) for c in "abcdefghijklmnopqrstuvwxyz0123456789"]
    T5Tokenizer(vocab=pieces, extra_ids=0, model_max_length=max_length).save_pretrained(directory)
