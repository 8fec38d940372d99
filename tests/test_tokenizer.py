"""Tokenizer tests: the char tokenizer covers every task text, BPE trains offline."""
from __future__ import annotations

import json

import pytest

from target_training.tasks import get_task
from target_training.tokenizer import (CharTokenizer, HFTokenizer, load_tokenizer, train_bpe)


def task_texts(n: int = 300) -> list[str]:
    texts = []
    for name in ("arith", "sort"):  # the char tokenizer's tasks (word and champ are for a real model's tokenizer)
        task = get_task(name)
        for split in ("train", "heldout"):
            for ex in task.examples(split, n, seed=3):
                texts.extend(ex.prompt + task.completion(ex, style) for style in task.styles)
    return texts


def test_char_vocab_layout():
    tok = CharTokenizer()
    assert tok.vocab_size <= 64
    assert (tok.pad_id, tok.bos_id, tok.eos_id) == (0, 1, 2)
    ids = tok.encode("0123456789abcdefghijklmnopqrstuvwxyz +-*=,;:|()<>[]._?!/#")
    assert len(set(ids)) == len(ids) and min(ids) == 3 and max(ids) < tok.vocab_size


def test_char_round_trip_on_all_task_texts():
    tok = CharTokenizer()
    for text in task_texts():
        ids = tok.encode(text, add_bos=True)
        assert ids[0] == tok.bos_id
        assert tok.decode(ids) == text


def test_char_specials_in_decode():
    tok = CharTokenizer()
    ids = tok.encode("1+2=", add_bos=True, add_eos=True) + [tok.pad_id]
    assert tok.decode(ids) == "1+2="
    assert tok.decode(ids, skip_special=False) == "<bos>1+2=<eos><pad>"


@pytest.mark.parametrize("bad", ["A", "é", "\t", "{"])
def test_char_unknown_character_raises(bad):
    with pytest.raises(ValueError) as err:
        CharTokenizer().encode(f"12{bad}3")
    msg = str(err.value)
    assert repr(bad) in msg and "\n" not in msg


def test_char_unknown_id_raises():
    tok = CharTokenizer()
    with pytest.raises(ValueError, match="no token id"):
        tok.decode([5, tok.vocab_size])


def test_char_save_and_load(tmp_path):
    tok = CharTokenizer()
    path = tok.save(tmp_path / "tok")
    assert json.loads(path.read_text())["kind"] == "char"
    loaded = load_tokenizer(str(tmp_path / "tok"))
    assert isinstance(loaded, CharTokenizer)
    assert loaded.vocab_size == tok.vocab_size
    assert loaded.encode("sort 3 1:") == tok.encode("sort 3 1:")
    assert isinstance(load_tokenizer("char"), CharTokenizer)


def test_bpe_trains_offline_and_round_trips(tmp_path):
    texts = task_texts(100)
    bpe = train_bpe(texts, vocab_size=320, out_dir=tmp_path / "bpe")
    assert isinstance(bpe, HFTokenizer)
    assert (bpe.pad_id, bpe.bos_id, bpe.eos_id) == (0, 1, 2)
    assert 259 < bpe.vocab_size <= 320
    for text in texts[:200] + ["unseen: Ω and TABS\tok"]:
        ids = bpe.encode(text, add_bos=True, add_eos=True)
        assert ids[0] == bpe.bos_id and ids[-1] == bpe.eos_id
        assert bpe.decode(ids) == text
    # Merges were learned: task texts take fewer tokens than characters.
    assert sum(len(bpe.encode(t)) for t in texts) < 0.8 * sum(len(t) for t in texts)

    reloaded = load_tokenizer(str(tmp_path / "bpe"))
    assert isinstance(reloaded, HFTokenizer)
    assert reloaded.encode(texts[0]) == bpe.encode(texts[0])
    assert (reloaded.pad_id, reloaded.bos_id, reloaded.eos_id) == (0, 1, 2)


def test_bpe_vocab_too_small():
    with pytest.raises(ValueError, match="vocab_size >= 259"):
        train_bpe(["1+2=3"], vocab_size=100)


def test_hf_explicit_ids_survive_save(tmp_path):
    bpe = train_bpe(task_texts(20), vocab_size=280)
    custom = HFTokenizer(bpe._tok, pad_id=2, bos_id=1, eos_id=0)
    custom.save(tmp_path / "c")
    again = HFTokenizer(tmp_path / "c")
    assert (again.pad_id, again.bos_id, again.eos_id) == (2, 1, 0)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        HFTokenizer(bpe._tok, eos_id=10_000)


def test_hf_missing_folder_errors_clearly(tmp_path):
    missing = tmp_path / "nope"
    with pytest.raises(FileNotFoundError) as err:
        HFTokenizer(missing)
    assert "does not exist" in str(err.value) and "\n" not in str(err.value)
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="no tokenizer.json"):
        HFTokenizer(tmp_path / "empty")
    with pytest.raises(FileNotFoundError, match="neither 'char' nor an existing folder"):
        load_tokenizer(str(missing))
