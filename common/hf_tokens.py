"""The recipe's tokens in Hugging Face's ``tokenizers`` library, for common/hf_gpt2.py (GPT-2 folders) and
recipes/tiny_transformer.py.

Tokens, as the ``tokenizers`` library expresses them (``tokenizer.json``, which ``AutoTokenizer`` loads):

- bytes (the recipe's ``vocab`` None): byte-level BPE without merges. The ByteLevel pre-tokenizer maps each byte
  to one printable character (GPT-2's alphabet of 256), the vocabulary maps that character to the byte's value,
  and with no merges every byte stays its own token: token b is byte b, as in the recipe;
- characters (``vocab`` a string): a WordLevel model over the characters, ids in the vocabulary's order, after a
  pre-tokenizer that splits the text into single characters (``Split`` on the regex ``[\\s\\S]``), and a ``Fuse``
  decoder that joins them without spaces. A character outside the vocabulary is an error there too;
- a folder's own tokenizer (GPT-2's BPE): read from its ``tokenizer.json``, or built by ``AutoTokenizer`` from
  ``vocab.json`` and ``merges.txt``, kept as it is, and stored in the checkpoint as its JSON text, so a resume,
  ``--sample-only`` and an export need the folder no more. A folder whose tokenizer is one of the two above
  gives the recipe's bytes or characters again.

``tokenizers`` (and, for GPT-2's vocab.json and merges.txt, ``transformers``) is imported inside the functions that
use it: a recipe run that neither reads nor writes a folder never loads it.
"""

import json
import re
from pathlib import Path

import torch

from common.cli import RecipeError

END_OF_TEXT = "<|endoftext|>"  # GPT-2's one special token: bos, eos and unk
PIECE = 1 << 16  # characters of a text encoded at a time (encode_text: some 50 MB at the peak)
LINE_START = re.compile(r"(?<=\S)\n(?=\S)")  # a newline between non-space characters: where a piece may end


def whole(tokenizer):
    """``tokenizer`` without truncation or padding (transformers saves them once a call used them): a corpus is
    encoded whole, a prompt as it is."""
    tokenizer.no_truncation()
    tokenizer.no_padding()
    return tokenizer


def encode_text(tokenizer, text: str) -> torch.Tensor:
    """``text``'s token ids (int32), without special tokens. A whole text's Encoding keeps every token's string and
    offsets (some 300 bytes a token: gigabytes for a 100 MB text), so a long one is encoded a piece of about
    ``PIECE`` characters at a time, each ending at a newline between non-space characters where the tokenizer
    allows it (``cuts_at_line_starts``): the ids are the whole text's. (Not after other whitespace: GPT-2's
    pre-tokenizer keeps "\n\n" or "\r\n" whole at a text's end, where inside it they part.)"""
    start, ids, cuts = 0, [], cuts_at_line_starts(tokenizer)
    while start < len(text):
        cut = LINE_START.search(text, start + PIECE) if cuts else None
        end = cut.end() if cut else len(text)
        ids.append(torch.tensor(tokenizer.encode(text[start:end], add_special_tokens=False).ids, dtype=torch.int32))
        start = end
    return torch.cat(ids) if ids else torch.zeros(0, dtype=torch.int32)


def cuts_at_line_starts(tokenizer) -> bool:
    """Whether a text cut at a newline between non-space characters encodes to the whole text's ids, as GPT-2's
    does: no normalizer, a pre-tokenizer that ends a pre-token there and reads what follows as it would a text's
    start (no prefix space added), and no added token that holds a newline, takes in the whitespace beside it, or
    matches only as a whole word."""
    if tokenizer.pre_tokenizer is None or tokenizer.normalizer is not None or any(
            token.lstrip or token.rstrip or token.single_word or "\n" in token.content
            for token in tokenizer.get_added_tokens_decoder().values()):
        return False
    last = tokenizer.pre_tokenizer.pre_tokenize_str("a\nb")[-1]
    return last == (tokenizer.pre_tokenizer.pre_tokenize_str("b")[0][0], (2, 3))


def read_tokenizer(path: Path):
    """The folder's tokenizer: tokenizer.json, else AutoTokenizer's from vocab.json and merges.txt (GPT-2's files)."""
    from tokenizers import Tokenizer

    if (path / "tokenizer.json").is_file():
        try:
            return whole(Tokenizer.from_file(str(path / "tokenizer.json")))
        except Exception as err:  # tokenizers raises a plain Exception for a file it cannot parse
            reason = (str(err).strip().splitlines() or [type(err).__name__])[0][:200]
            raise RecipeError(f"cannot read {path / 'tokenizer.json'}: {reason}") from None
    if not ((path / "vocab.json").is_file() and (path / "merges.txt").is_file()):
        raise RecipeError(f"{path} has no tokenizer: tokenizer.json, or GPT-2's vocab.json and merges.txt")
    from transformers import AutoTokenizer

    try:
        return whole(AutoTokenizer.from_pretrained(str(path), local_files_only=True).backend_tokenizer)
    except Exception as err:
        reason = (str(err).strip().splitlines() or [type(err).__name__])[0][:200]
        raise RecipeError(f"cannot read {path}'s vocab.json and merges.txt: {reason}") from None


def tokenizer_for(vocab: object):
    """The recipe's tokens as a ``tokenizers.Tokenizer`` (see the module's docstring); a tokenizer stays itself."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    if vocab is None:  # bytes: token b is byte b
        alphabet = byte_alphabet()
        tokenizer = Tokenizer(models.BPE(vocab={alphabet[b]: b for b in range(256)}, merges=[]))
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        tokenizer.decoder = decoders.ByteLevel()
        return tokenizer
    if isinstance(vocab, str):  # characters: token i is vocab[i]
        tokenizer = Tokenizer(models.WordLevel(vocab={ch: i for i, ch in enumerate(vocab)}, unk_token=None))
        tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")  # every character
        tokenizer.decoder = decoders.Fuse()  # joined as they are, no spaces between
        return tokenizer
    return vocab


def byte_alphabet() -> dict[int, str]:
    """GPT-2's byte -> printable character map (the ByteLevel pre-tokenizer's): printable Latin-1 bytes stand for
    themselves, the other 68 for the characters from U+0100 on, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    return {**{b: chr(b) for b in printable}, **{b: chr(256 + i) for i, b in enumerate(others)}}


# Text that holds every kind of character: control, ASCII, Latin-1, 2-, 3- and 4-byte UTF-8
PROBE = "".join(map(chr, range(0x180))) + " \u20ac \u6f22\u5b57 \U0001f642\r\n"


def tokenizes_as(tokenizer, text: str, ids: list[int]) -> bool:
    try:
        return tokenizer.encode(text).ids == ids and tokenizer.decode(ids, skip_special_tokens=False) == text
    except Exception:  # a character it does not know
        return False


def recipe_vocab(tokenizer) -> tuple[str, object]:
    """(vocab_kind, vocab): the recipe's bytes or characters if the tokenizer gives exactly their tokens (as an
    export writes them; transformers rewrites some of the JSON when it saves one), else the tokenizer itself."""
    size = tokenizer.get_vocab_size()
    if size == 256 and tokenizes_as(tokenizer, PROBE, list(PROBE.encode())):
        return "bytes", None
    ids = tokenizer.get_vocab()
    vocab = "".join(sorted(ids, key=ids.get))
    if json.loads(tokenizer.to_str())["model"].get("type") == "WordLevel" and len(vocab) == size == len(ids) and \
            tokenizes_as(tokenizer, vocab + vocab[::-1], [*range(size), *reversed(range(size))]):
        return "chars", vocab
    return "tokenizer", tokenizer


def describe(kind: str, vocab: object) -> str:
    if kind == "bytes":
        return "tokenizer of bytes"
    if kind == "chars":
        return f"tokenizer of {len(vocab)} characters"
    model = json.loads(vocab.to_str())["model"].get("type", "its own")
    return f"tokenizer ({model}, {vocab.get_vocab_size()} tokens)"


def vocab_state(vocab: object) -> dict:
    """What a checkpoint keeps of the recipe's tokens: ``vocab`` (None: bytes; a string: characters) and
    ``tokenizer``, a folder's tokenizer as its JSON text (then ``vocab`` is None)."""
    if vocab is None or isinstance(vocab, str):
        return {"vocab": vocab, "tokenizer": None}
    return {"vocab": None, "tokenizer": vocab.to_str()}


def checkpoint_vocab(checkpoint: dict) -> object:
    """The recipe's tokens from a checkpoint (``vocab_state``'s entries): None, a string, or a tokenizer."""
    if not checkpoint.get("tokenizer"):
        if checkpoint.get("vocab") is not None and not isinstance(checkpoint["vocab"], str):
            raise RecipeError(f"the checkpoint's vocabulary is damaged (a {type(checkpoint['vocab']).__name__}, not "
                              "None or a string of characters)")
        return checkpoint.get("vocab")
    from tokenizers import Tokenizer

    try:
        return whole(Tokenizer.from_str(checkpoint["tokenizer"]))
    except Exception:
        raise RecipeError("the checkpoint's tokenizer is damaged (not a tokenizers JSON)") from None
