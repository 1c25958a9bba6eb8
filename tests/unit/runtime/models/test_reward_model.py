"""The reward model: a one-label sequence classifier scoring texts at their last real token."""

from __future__ import annotations

import pytest
import torch

from rldock.runtime.models.reward_classifier import load_reward_model

TEXTS = ["3+4=7", "12+30=42", "9+9=18 and more words"]


def test_scores_do_not_depend_on_the_padding_of_the_batch(tmp_path, tiny_reward_model):
    path = tiny_reward_model(tmp_path / "rm", texts=TEXTS)
    rm = load_reward_model(path, dtype="float32", device="cpu", field="reward.terms[0].path")
    assert rm.model.config.pad_token_id == rm.tokenizer.pad_token_id  # unset in the saved config
    together = rm.score(TEXTS)  # (B,), the short texts padded to the longest
    assert together.dtype == torch.float32 and together.shape == (3,)
    alone = torch.cat([rm.score([text]) for text in TEXTS])
    torch.testing.assert_close(together, alone, atol=1e-5, rtol=1e-5)
    assert len(set(together.tolist())) == 3  # a random head tells the texts apart


def test_a_constant_head_scores_every_text_the_constant(tmp_path, tiny_reward_model):
    path = tiny_reward_model(tmp_path / "rm", texts=TEXTS, constant=0.75)
    scores = load_reward_model(path, dtype="float32", device="cpu", field="f").score(TEXTS)
    torch.testing.assert_close(scores, torch.full((3,), 0.75), atol=1e-5, rtol=0)


def test_more_than_one_label_is_refused_naming_the_field(tmp_path, tiny_reward_model):
    path = tiny_reward_model(tmp_path / "rm", texts=TEXTS, num_labels=2)
    with pytest.raises(ValueError, match=r"reward.terms\[1\].path: .* num_labels 2; a reward model gives one scalar"):
        load_reward_model(path, dtype="float32", device="cpu", field="reward.terms[1].path")


def test_a_folder_without_a_fast_tokenizer_is_refused(tmp_path, tiny_reward_model):
    path = tiny_reward_model(tmp_path / "rm", texts=TEXTS)
    (path / "tokenizer.json").unlink()
    with pytest.raises(ValueError, match=r"reward.terms\[0\].path: .* has no tokenizer.json"):
        load_reward_model(path, dtype="float32", device="cpu", field="reward.terms[0].path")


def test_a_tokenizer_without_a_pad_token_pads_with_eos(tmp_path, tiny_reward_model):
    path = tiny_reward_model(tmp_path / "rm", texts=TEXTS)
    config = path / "tokenizer_config.json"
    config.write_text(config.read_text().replace('"pad_token": "<pad>"', '"pad_token": null'))
    rm = load_reward_model(path, dtype="float32", device="cpu", field="f")
    assert rm.tokenizer.pad_token == "<eos>" and rm.model.config.pad_token_id == rm.tokenizer.eos_token_id
    torch.testing.assert_close(rm.score(TEXTS[:2]), torch.cat([rm.score([t]) for t in TEXTS[:2]]), atol=1e-5, rtol=1e-5)
