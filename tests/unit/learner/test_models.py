"""The embedded default policy: char tokenizer, tiny Llama, SFT warm start (offline, CPU)."""

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from trajmesh.envs import chain_sum  # noqa: E402
from trajmesh.learner.models import (  # noqa: E402
    build_char_tokenizer,
    build_sft_batch,
    build_tiny_model,
    encode_answer,
    encode_prompt,
    load_model,
    num_parameters,
    sft,
)


def _build_tiny(tmp_path: Path, **dims) -> Path:
    build_char_tokenizer(tmp_path / "tok")
    build_tiny_model(tmp_path / "model", tmp_path / "tok", **{"hidden": 32, "layers": 2, "heads": 2, **dims})
    return tmp_path / "model"


def test_tokenizer_round_trip_and_offline_load(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    build_char_tokenizer(tmp_path / "tok")
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "tok")
    text = "12+7-3=16"
    ids = tok(text)["input_ids"]
    assert ids[0] == tok.bos_token_id and len(ids) == len(text) + 1
    assert tok.decode(ids, skip_special_tokens=True) == text
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id) == (0, 1, 2)
    assert encode_answer(tok, "-16") == tok("-16", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    assert tok.decode(encode_prompt(tok, "(1 * 2)="), skip_special_tokens=True) == "(1 * 2)="


def test_tiny_model_save_load(tmp_path):
    model_dir = _build_tiny(tmp_path, seed=3)
    assert (model_dir / "model.safetensors").exists() and (model_dir / "tokenizer.json").exists()
    model, tok = load_model(model_dir)
    assert model.config.tie_word_embeddings
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    ids = torch.tensor([encode_prompt(tok, "1+2=")])
    again, _ = load_model(model_dir)
    torch.testing.assert_close(model(ids).logits, again(ids).logits)
    assert num_parameters(model) > 0


def test_sft_masks_prompt_and_lowers_loss(tmp_path):
    model_dir = _build_tiny(tmp_path)
    _, tok = load_model(model_dir)
    tasks = chain_sum.make_tasks(7, 64, min_terms=2, max_terms=2, min_digits=1, max_digits=1)
    batch = build_sft_batch(tok, tasks[:4])
    for i, task in enumerate(tasks[:4]):
        n_prompt = len(encode_prompt(tok, task["prompt"]))
        answer = encode_answer(tok, task["answer"])
        labels = batch["labels"][i].tolist()
        assert labels[:n_prompt] == [-100] * n_prompt
        assert labels[n_prompt : n_prompt + len(answer)] == answer
        assert all(x == -100 for x in labels[n_prompt + len(answer) :])
    stats = sft(
        model_dir, tasks, steps=60, batch_size=8, lr=3e-3, out_dir=tmp_path / "sft", seed=0, warmup_steps=10
    )
    assert stats["loss_last"] < 0.6 * stats["loss_first"]
    assert (tmp_path / "sft" / "model.safetensors").exists()
