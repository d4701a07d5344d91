"""A small reference tokenizer read from a GGUF file's own metadata, and a transformers tokenizer built by its rules.

transformers rebuilds a GGUF model's tokenizer from the vocabulary the file stores, and for Gemma that rebuild has
been wrong before (transformers#41494) and still splits long whitespace runs unlike SentencePiece (see
:func:`sentencepiece_tokenizer`): a target whose tokenizer splits text differently from the one the model was
trained with still runs, but on inputs it never saw. So ``assets.py`` saves the tokenizer
:func:`sentencepiece_tokenizer` builds, and before the target is cached compares the saved tokenizer's ids with the
ones :class:`ReferenceTokenizer` computes straight from the metadata, on :func:`probe_strings`.

Only SentencePiece vocabularies (``tokenizer.ggml.model == "llama"``, Gemma's) are covered, with SentencePiece's
BPE rules: spaces become ``▁`` (after a dummy ``▁`` in front when ``tokenizer.ggml.add_space_prefix`` says so),
user-defined and control tokens (``\\n\\n``, tab and space runs, ``<start_of_turn>``) are matched whole first,
longest first, as transformers and llama.cpp do; the text between them starts as single characters and the
adjacent pair whose concatenation is a vocabulary token with the highest score merges first (leftmost on ties), or,
when the file lists merges, the pair with the lowest merge rank. A piece still missing from the vocabulary is
spelled in ``<0xXX>`` byte tokens. Byte-level ("gpt2") vocabularies need the pre-tokenizer regex their file only
names, so they are refused rather than checked wrongly.

Written for clarity, not speed (each merge rescans the stretch, so time grows with the square of its length): it
is meant for checks on short strings, not for serving.
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from dataclasses import dataclass, field

from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, processors
from transformers import PreTrainedTokenizerFast

__all__ = ["GGUFVocabulary", "ReferenceTokenizer", "probe_strings", "sentencepiece_tokenizer", "tokenizer_mismatches"]

SPACE = "\u2581"  # SentencePiece's visible space, "▁"
# tokenizer.ggml.token_type values (llama.cpp's llama_token_type)
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6
_BYTE_TOKEN = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


@dataclass
class GGUFVocabulary:
    """The tokenizer metadata of a GGUF file (the ``tokenizer.ggml.*`` keys), read once."""

    model: str
    tokens: list[str]
    scores: list[float]
    token_types: list[int]
    merges: list[str] = field(default_factory=list)
    bos_id: int | None = None
    eos_id: int | None = None
    unk_id: int | None = None
    pad_id: int | None = None
    add_bos: bool = False
    add_eos: bool = False
    add_space_prefix: bool = True
    chat_template: str | None = None

    @classmethod
    def from_gguf(cls, path: str | os.PathLike[str]) -> GGUFVocabulary:
        """Read the ``tokenizer.ggml.*`` metadata with the ``gguf`` package (no tensor data is loaded)."""
        from gguf import GGUFReader

        fields = GGUFReader(path).fields

        def value(key: str, default: object = None, prefix: str = "tokenizer.ggml.") -> object:
            return fields[prefix + key].contents() if prefix + key in fields else default

        tokens = list(value("tokens"))
        return cls(
            model=str(value("model")),
            tokens=tokens,
            scores=[float(s) for s in value("scores", [0.0] * len(tokens))],
            token_types=[int(t) for t in value("token_type", [NORMAL] * len(tokens))],
            merges=list(value("merges", [])),
            bos_id=value("bos_token_id"),
            eos_id=value("eos_token_id"),
            unk_id=value("unknown_token_id"),
            pad_id=value("padding_token_id"),
            # llama.cpp's defaults for a SentencePiece vocabulary that does not say
            add_bos=bool(value("add_bos_token", True)),
            add_eos=bool(value("add_eos_token", False)),
            add_space_prefix=bool(value("add_space_prefix", True)),
            chat_template=value("chat_template", prefix="tokenizer."),
        )


class ReferenceTokenizer:
    """SentencePiece-BPE encode/decode over a :class:`GGUFVocabulary`; see the module docstring for the rules."""

    def __init__(self, vocab: GGUFVocabulary) -> None:
        if vocab.model != "llama":
            raise ValueError(
                f"the reference tokenizer covers SentencePiece vocabularies (tokenizer.ggml.model 'llama'), "
                f"not {vocab.model!r}"
            )
        self.vocab = vocab
        types = vocab.token_types
        # SentencePiece merges into normal and user-defined pieces only; control and byte tokens are never the
        # result of a merge.
        self._mergeable = {t: i for i, t in enumerate(vocab.tokens) if types[i] in (NORMAL, USER_DEFINED)}
        self._merge_rank = {tuple(m.split(" ", 1)): rank for rank, m in enumerate(vocab.merges)}
        self._bytes = {
            int(m.group(1), 16): i
            for i, t in enumerate(vocab.tokens)
            if types[i] == BYTE and (m := _BYTE_TOKEN.match(t))
        }
        whole = sorted((t for i, t in enumerate(vocab.tokens) if types[i] in (CONTROL, USER_DEFINED) and t), key=len,
                       reverse=True)
        self._whole_ids = {t: i for i, t in enumerate(vocab.tokens) if types[i] in (CONTROL, USER_DEFINED)}
        self._whole = re.compile("|".join(map(re.escape, whole))) if whole else None

    # -- encoding ------------------------------------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``, with BOS / EOS as the file's ``add_bos_token`` / ``add_eos_token`` ask."""
        if self.vocab.add_space_prefix:
            text = " " + text
        ids: list[int] = []
        start = 0
        for match in self._whole.finditer(text) if self._whole else ():
            ids += self._encode_plain(text[start:match.start()])
            ids.append(self._whole_ids[match.group()])
            start = match.end()
        ids += self._encode_plain(text[start:])
        if add_special_tokens and self.vocab.add_bos and self.vocab.bos_id is not None:
            ids.insert(0, self.vocab.bos_id)
        if add_special_tokens and self.vocab.add_eos and self.vocab.eos_id is not None:
            ids.append(self.vocab.eos_id)
        return ids

    def _encode_plain(self, text: str) -> list[int]:
        """Ids of a stretch of text holding no whole-matched token: merge characters, then spell leftovers in bytes."""
        pieces = list(text.replace(" ", SPACE))
        while len(pieces) > 1:
            best, best_priority = None, None
            for i in range(len(pieces) - 1):
                priority = self._priority(pieces[i], pieces[i + 1])
                if priority is not None and (best_priority is None or priority > best_priority):
                    best, best_priority = i, priority
            if best is None:
                break
            pieces[best:best + 2] = [pieces[best] + pieces[best + 1]]
        return [i for piece in pieces for i in self._piece_ids(piece)]

    def _priority(self, left: str, right: str) -> float | None:
        """How eagerly two adjacent pieces merge (higher first), or None when they cannot."""
        if left + right not in self._mergeable:
            return None
        if self._merge_rank:
            rank = self._merge_rank.get((left, right))
            return None if rank is None else -rank
        return self.vocab.scores[self._mergeable[left + right]]

    def _piece_ids(self, piece: str) -> list[int]:
        """The piece's own id, else its UTF-8 bytes as byte tokens (SentencePiece's byte fallback), else unknown."""
        if piece in self._mergeable:
            return [self._mergeable[piece]]
        data = piece.encode("utf-8")  # the normalised piece, "▁" included, as SentencePiece spells it
        if all(b in self._bytes for b in data):
            return [self._bytes[b] for b in data]
        if self.vocab.unk_id is None:
            raise ValueError(f"{piece!r} is not in the vocabulary, which has neither byte tokens nor <unk>")
        return [self.vocab.unk_id]

    # -- decoding ------------------------------------------------------------------------------------------------

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of ``ids``: ``▁`` back to spaces, byte tokens joined into UTF-8; control tokens skipped if asked."""
        data = bytearray()
        byte_ids = {i: b for b, i in self._bytes.items()}
        for i in ids:
            if skip_special_tokens and self.vocab.token_types[i] == CONTROL:
                continue
            if i in byte_ids:
                data.append(byte_ids[i])
            else:
                data += self.vocab.tokens[i].replace(SPACE, " ").encode("utf-8")
        text = data.decode("utf-8", errors="replace")
        return text[1:] if self.vocab.add_space_prefix and text.startswith(" ") else text


# -------------------------------------------------------------------------------------------------------------------
# A transformers tokenizer built from the same rules
# -------------------------------------------------------------------------------------------------------------------


def _merges_by_score(vocab: GGUFVocabulary) -> list[tuple[str, str]]:
    """The merges with which a rank-ordered BPE (``tokenizers``) reproduces SentencePiece's merge by score: every
    split of every normal token into two normal tokens, ordered by the merged token's score, best first."""
    normal = {t for t, kind in zip(vocab.tokens, vocab.token_types) if kind == NORMAL}
    ranked = sorted((i for i, kind in enumerate(vocab.token_types) if kind == NORMAL), key=lambda i: -vocab.scores[i])
    return [
        (token[:k], token[k:])
        for token in (vocab.tokens[i] for i in ranked)
        for k in range(1, len(token))
        if token[:k] in normal and token[k:] in normal
    ]


def sentencepiece_tokenizer(vocab: GGUFVocabulary) -> PreTrainedTokenizerFast:
    """A transformers tokenizer for a SentencePiece GGUF vocabulary that follows the reference's rules.

    transformers' own GGUF rebuild spells Gemma's whitespace-run tokens ("  " ... 31 spaces) as "▁▁" pieces and
    merges them by rank, so a run longer than the longest token splits differently from SentencePiece (36 spaces:
    16 + 20 instead of 31 + 5, and a word after 32 spaces loses its "▁"). Here every user-defined and control
    token keeps its own spelling and is matched whole before normalisation, as SentencePiece's prefix matcher does;
    the rest is ``▁``-normalised and merged by score (by rank when the file lists merges), with byte fallback.
    """
    if vocab.model != "llama":
        raise ValueError(f"only SentencePiece vocabularies (tokenizer.ggml.model 'llama') are built here, not "
                         f"{vocab.model!r}")
    if vocab.add_space_prefix:
        # SentencePiece puts "▁" once in front of the whole text, even one starting with a space; a normalizer would
        # put it after every whole-matched token and tokenizers' Metaspace skips it before a leading space.
        raise ValueError("a vocabulary with tokenizer.ggml.add_space_prefix is not built here (Gemma's has none)")
    if len(set(vocab.tokens)) != len(vocab.tokens):
        raise ValueError("the GGUF vocabulary spells two tokens the same")

    def name(token_id: int | None) -> str | None:
        return None if token_id is None else vocab.tokens[token_id]

    model = models.BPE(
        vocab={token: i for i, token in enumerate(vocab.tokens)},
        merges=[tuple(m.split(" ", 1)) for m in vocab.merges] or _merges_by_score(vocab),
        unk_token=name(vocab.unk_id), byte_fallback=True, fuse_unk=True,
    )
    backend = Tokenizer(model)
    backend.normalizer = normalizers.Replace(" ", SPACE)  # applied between whole-matched tokens
    backend.decoder = decoders.Sequence([decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()])
    kinds = vocab.token_types
    backend.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t, kind in zip(vocab.tokens, kinds) if kind == CONTROL]
    )
    backend.add_tokens(
        [AddedToken(t, special=False, normalized=False) for t, kind in zip(vocab.tokens, kinds) if kind == USER_DEFINED]
    )
    bos, eos = name(vocab.bos_id), name(vocab.eos_id)
    start, end = [bos] * (vocab.add_bos and bos is not None), [eos] * (vocab.add_eos and eos is not None)
    single = " ".join([f"{t}:0" for t in start] + ["$A:0"] + [f"{t}:0" for t in end])
    pair = single + " " + " ".join([f"{t}:1" for t in start] + ["$B:1"] + [f"{t}:1" for t in end])
    ids = {bos: vocab.bos_id, eos: vocab.eos_id}
    backend.post_processor = processors.TemplateProcessing(
        single=single, pair=pair, special_tokens=[(t, ids[t]) for t in dict.fromkeys(start + end)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token=bos, eos_token=eos, unk_token=name(vocab.unk_id),
        pad_token=name(vocab.pad_id), add_bos_token=bool(start), add_eos_token=bool(end),
        chat_template=vocab.chat_template,
    )


# -------------------------------------------------------------------------------------------------------------------
# The comparison the target build runs
# -------------------------------------------------------------------------------------------------------------------

_PYTHON = '''def fibonacci(n: int) -> list[int]:
    """Return the first n Fibonacci numbers."""
    result = [0, 1]
    while len(result) < n:
\tresult.append(result[-1] + result[-2])
    return result[:n]


class Stack:
    def __init__(self):
        self.items = []  # top is the end

    def push(self, x):
        self.items.append(x)
'''

_PROSE = (
    "The quick brown fox jumps over the lazy dog. It's 3:45 p.m., and the temperature is -12.5\u00b0C!",
    "Speculative decoding drafts several tokens, then the target verifies them in one forward pass.",
    "In 1969, Apollo 11 landed on the Moon; Neil Armstrong said: \"That's one small step for [a] man.\"",
    "E-mail me at someone@example.com or visit https://example.org/path?query=1&x=2#frag.",
    "Well... I don't know -- maybe? (Probably not.) Let's see: a) yes; b) no; c) 50/50.",
)
_SCRIPTS = (
    "今天天气很好，我们去公园散步吧。",  # Chinese
    "मैं हिंदी बोलता हूँ।",  # Hindi
    "Привет, как дела? Всё хорошо.",  # Russian
    "Καλημέρα κόσμε, τι κάνεις;",  # Greek
    "مرحبا بالعالم، كيف حالك؟",  # Arabic
    "日本語の文章とカタカナ。",  # Japanese
    "한국어 문장입니다.",  # Korean
    "Café naïve façade über Ångström łódź",  # Latin diacritics
)
_SYMBOLS = (  # emoji (skin tone, ZWJ family, variation selector), maths, rare planes and odd spaces, digits
    "\U0001f600\U0001f44d\U0001f3fd \U0001f468\u200d\U0001f469\u200d\U0001f467 \u2764\ufe0f \U0001f680\U0001f30d",
    "∑ x² ≤ ∞, α→β, ∀ε>0 ∃δ",
    "\U0001d539\U0001d54a \U00010348 \ufffd \u00a0non-breaking\u2003em-space",
    "0 1 12 123 1234 12345 3.14159 1e-9 0x1F 1,000,000 -42 +7",
)
_WHITESPACE = (
    "a  b   c    d", "  leading", "trailing   ", "tab\there\t\tand\t\t\tthere", "line\nbreak\n\npara\n\n\n",
    " \n \t \n", "mixed \t \n  \n\t end", "    indented\n        deeper\n",
    # Runs longer than the longest whitespace token (Gemma: 31), as aligned continuation lines in code have.
    " " * 32 + "x", "f(a,\n" + " " * 36 + "b)", " " * 64, "\t" * 40 + "y", "\n" * 40,
)
_MARKUP = (
    "<div><b>bold</b> and <i>italic</i></div>", "<start_of_turn>user\nHi!<end_of_turn>\n", "<table><tr><td>1</td>",
)


def probe_strings() -> list[str]:
    """About 250 fixed, varied strings: code, prose, many scripts, emoji, digits, whitespace runs, markup.

    Built from a small set of samples by taking each whole, each line, each word, word pairs and a few joins, so the
    same strings probe both long stretches and word-sized pieces. Deterministic, so a failing string can be re-run.
    """
    samples = [_PYTHON, *_PROSE, *_SCRIPTS, *_SYMBOLS, *_WHITESPACE, *_MARKUP]
    strings = list(samples)
    strings += [line for sample in samples for line in sample.splitlines() if line.strip()]
    words = [sample.split() for sample in _PROSE + _SCRIPTS + _SYMBOLS]
    strings += [word for sample in words for word in sample]
    strings += [" ".join(sample[i:i + 2]) for sample in words for i in range(0, len(sample) - 1, 2)]
    strings += ["    " + line for line in _PYTHON.splitlines() if line.strip()]
    strings += [" " + s for s in _PROSE + _SCRIPTS] + [s + "\n" for s in _SCRIPTS + _SYMBOLS]
    strings += [_PROSE[i] + " " + _SCRIPTS[i] for i in range(len(_PROSE))] + ["", " ", "\n", "\t", "a"]
    return list(dict.fromkeys(strings))


def tokenizer_mismatches(tokenizer: object, reference: ReferenceTokenizer, strings: Sequence[str]) -> list[str]:
    """One line per problem: a string whose Hugging Face ids differ from the reference's (BOS / EOS included), or
    which either tokenizer does not decode back to itself (encoded without BOS / EOS, decoded keeping control
    tokens); empty when all agree."""
    problems = []
    for text in strings:
        ours = reference.encode(text)
        theirs = [int(i) for i in tokenizer(text)["input_ids"]]
        if theirs != ours:
            problems.append(f"{text!r}: transformers {theirs[:16]} vs reference {ours[:16]}")
        decoded = {
            "reference": reference.decode(reference.encode(text, add_special_tokens=False), skip_special_tokens=False),
            "transformers": tokenizer.decode(tokenizer(text, add_special_tokens=False)["input_ids"],
                                             skip_special_tokens=False),
        }
        problems += [f"{text!r}: {name} decodes it to {back!r}" for name, back in decoded.items() if back != text]
    return problems
