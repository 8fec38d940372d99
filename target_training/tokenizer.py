"""Tokenizers for the MoE policy.

Why a character tokenizer ships in the package: the built-in tasks (addition, sorting)
use a tiny alphabet, and one token per character keeps every step of a worked answer
visible to the model and to speculative drafters. It needs no files and no downloads,
so a checkpoint and its tokenizer can never drift apart. Its vocabulary fits the
default `MoEConfig.vocab_size` of 64.

Users who bring their own data may prefer BPE. `HFTokenizer` wraps a local
`tokenizers.Tokenizer` folder behind the same small interface, and `train_bpe` builds
one offline from a list of texts. `load_tokenizer` picks the right class from a spec.

Shared interface: `vocab_size`, `pad_id`, `bos_id`, `eos_id`, `encode`, `encode_prompt` (a task
prompt as the policy reads it), `decode`, `save`.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable, Sequence

PAD, BOS, EOS = "<pad>", "<bos>", "<eos>"
SPECIAL_TOKENS = (PAD, BOS, EOS)
# Order matters: it fixes the ids (specials 0..2, then these characters from 3 on).
DEFAULT_ALPHABET = "0123456789abcdefghijklmnopqrstuvwxyz +-*=,;:|()<>[]._?!/#\n"
TOKENIZER_FILE = "tokenizer.json"
SPECIAL_IDS_FILE = "special_ids.json"

# Names that common tokenizers give their special tokens, tried in order.
PAD_NAMES = (PAD, "[PAD]", "<|pad|>", "<|padding|>")
BOS_NAMES = (BOS, "<s>", "[CLS]", "<|begin_of_text|>", "<|startoftext|>", "<|im_start|>")
EOS_NAMES = (EOS, "</s>", "[SEP]", "<|end_of_text|>", "<|endoftext|>", "<|im_end|>", "<|eot_id|>")


class CharTokenizer:
    """One id per character; three specials first, then a fixed alphabet."""

    kind = "char"

    def __init__(self, alphabet: str = DEFAULT_ALPHABET):
        if len(set(alphabet)) != len(alphabet):
            raise ValueError("CharTokenizer alphabet has repeated characters")
        self.alphabet = alphabet
        self.pad_id, self.bos_id, self.eos_id = 0, 1, 2
        offset = len(SPECIAL_TOKENS)
        self._char_to_id = {ch: i + offset for i, ch in enumerate(alphabet)}
        self._id_to_char = {i: ch for ch, i in self._char_to_id.items()}
        self.vocab_size = offset + len(alphabet)

    def encode(self, text: str, add_bos: bool = False, add_eos: bool = False) -> list[int]:
        ids = [self.bos_id] if add_bos else []
        for ch in text:
            if ch not in self._char_to_id:
                raise ValueError(f"CharTokenizer cannot encode character {ch!r} (not in its alphabet)")
            ids.append(self._char_to_id[ch])
        if add_eos:
            ids.append(self.eos_id)
        return ids

    def encode_prompt(self, text: str) -> list[int]:
        """A task prompt as the policy reads it: bos + the text."""
        return self.encode(text, add_bos=True)

    def decode(self, ids: Iterable[int], skip_special: bool = True) -> str:
        out = []
        for i in ids:
            i = int(i)
            if 0 <= i < len(SPECIAL_TOKENS):
                if not skip_special:
                    out.append(SPECIAL_TOKENS[i])
            elif i in self._id_to_char:
                out.append(self._id_to_char[i])
            else:
                raise ValueError(f"CharTokenizer has no token id {i} (vocab_size {self.vocab_size})")
        return "".join(out)

    def save(self, directory: str | Path) -> Path:
        """Write `tokenizer.json` of kind "char" so `load_tokenizer(directory)` restores it."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        path = directory / TOKENIZER_FILE
        payload = {"kind": self.kind, "specials": list(SPECIAL_TOKENS), "alphabet": self.alphabet}
        path.write_text(json.dumps(payload, indent=1))
        return path

    @classmethod
    def load(cls, directory: str | Path) -> "CharTokenizer":
        path = Path(directory) / TOKENIZER_FILE
        payload = _read_json(path)
        if payload.get("kind") != cls.kind:
            raise ValueError(f"{path} is not a char tokenizer file")
        if list(payload.get("specials", [])) != list(SPECIAL_TOKENS):
            raise ValueError(f"{path} has specials {payload.get('specials')}, expected {list(SPECIAL_TOKENS)}")
        return cls(payload["alphabet"])

    def __repr__(self) -> str:
        return f"CharTokenizer(vocab_size={self.vocab_size})"


class HFTokenizer:
    """A local `tokenizers.Tokenizer` behind the same interface as `CharTokenizer`.

    Special ids are taken from the arguments, else from `special_ids.json` written by
    `save`, else found by common special-token names. A missing pad falls back to eos.
    """

    kind = "hf"

    def __init__(self, source, pad_id: int | None = None, bos_id: int | None = None,
                 eos_id: int | None = None):
        from tokenizers import Tokenizer

        saved: dict = {}
        if isinstance(source, Tokenizer):
            self._tok = source
        else:
            folder = Path(source)
            path = folder / TOKENIZER_FILE
            if not folder.is_dir():
                raise FileNotFoundError(f"tokenizer folder {str(folder)!r} does not exist")
            if not path.is_file():
                raise FileNotFoundError(f"tokenizer folder {str(folder)!r} has no {TOKENIZER_FILE}")
            self._tok = Tokenizer.from_file(str(path))
            if (folder / SPECIAL_IDS_FILE).is_file():
                saved = _read_json(folder / SPECIAL_IDS_FILE)
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self.bos_id = self._pick("bos", bos_id, saved, BOS_NAMES)
        self.eos_id = self._pick("eos", eos_id, saved, EOS_NAMES)
        try:
            self.pad_id = self._pick("pad", pad_id, saved, PAD_NAMES)
        except ValueError:
            self.pad_id = self.eos_id

    def _pick(self, role: str, given: int | None, saved: dict, names: Sequence[str]) -> int:
        if given is None:
            given = saved.get(f"{role}_id")
        if given is not None:
            if not 0 <= int(given) < self.vocab_size:
                raise ValueError(f"{role}_id {given} is outside the vocabulary (size {self.vocab_size})")
            return int(given)
        for name in names:
            found = self._tok.token_to_id(name)
            if found is not None:
                return found
        raise ValueError(f"tokenizer has no {role} token among {list(names)}; pass {role}_id explicitly")

    def encode(self, text: str, add_bos: bool = False, add_eos: bool = False) -> list[int]:
        ids = self._tok.encode(text, add_special_tokens=False).ids
        return ([self.bos_id] if add_bos else []) + list(ids) + ([self.eos_id] if add_eos else [])

    def encode_prompt(self, text: str) -> list[int]:
        """A task prompt as the policy reads it: bos + the text."""
        return self.encode(text, add_bos=True)

    def decode(self, ids: Iterable[int], skip_special: bool = True) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=skip_special)

    def save(self, directory: str | Path) -> Path:
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        path = directory / TOKENIZER_FILE
        self._tok.save(str(path))
        ids = {"pad_id": self.pad_id, "bos_id": self.bos_id, "eos_id": self.eos_id}
        (directory / SPECIAL_IDS_FILE).write_text(json.dumps(ids))
        return path

    def __repr__(self) -> str:
        return f"HFTokenizer(vocab_size={self.vocab_size})"


def train_bpe(texts: Iterable[str], vocab_size: int, out_dir: str | Path | None = None) -> HFTokenizer:
    """Train a byte-level BPE offline; specials `<pad>`, `<bos>`, `<eos>` get ids 0, 1, 2.

    Byte-level means every string round-trips, including characters never seen in
    training, so the vocabulary must hold the 256 byte symbols plus the specials.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    byte_alphabet = pre_tokenizers.ByteLevel.alphabet()
    minimum = len(byte_alphabet) + len(SPECIAL_TOKENS)
    if vocab_size < minimum:
        raise ValueError(f"train_bpe needs vocab_size >= {minimum} (256 bytes + specials), got {vocab_size}")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=byte_alphabet, show_progress=False)
    tok.train_from_iterator(list(texts), trainer=trainer)
    wrapped = HFTokenizer(tok)
    if out_dir is not None:
        wrapped.save(out_dir)
    return wrapped


def load_tokenizer(spec: str | Path):
    """`"char"` -> the built-in CharTokenizer; a folder -> whatever was saved in it."""
    if str(spec) == "char":
        return CharTokenizer()
    folder = Path(spec)
    if not folder.is_dir():
        raise FileNotFoundError(f"tokenizer spec {str(spec)!r} is neither 'char' nor an existing folder")
    path = folder / TOKENIZER_FILE
    if path.is_file() and _read_json(path).get("kind") == CharTokenizer.kind:
        return CharTokenizer.load(folder)
    return HFTokenizer(folder)


def _read_json(path: Path) -> dict:
    if not path.is_file():
        raise FileNotFoundError(f"tokenizer file {str(path)!r} does not exist")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from None
    return data if isinstance(data, dict) else {}
