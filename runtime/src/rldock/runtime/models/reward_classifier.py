"""A learned reward model: a Hugging Face sequence classifier with one label, loaded from a local
folder with its own tokenizer, that maps texts to one scalar each.

The reward model may have another vocabulary than the policy, so it never reads the policy's
token ids: the caller hands it text, which it tokenizes with its own tokenizer (with that
tokenizer's special tokens, e.g. BOS). Texts are right-padded; the classifier pools the logit of
the last token that is not `config.pad_token_id` (transformers' `...ForSequenceClassification`),
so a pad id must be set: the tokenizer's pad token, else its EOS.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoModelForSequenceClassification, PreTrainedModel, PreTrainedTokenizerFast

from rldock.runtime.models.loading import DTYPES, read_tokenizer


@dataclass
class RewardModel:
    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerFast
    device: torch.device

    @torch.no_grad()
    def score(self, texts: Sequence[str]) -> torch.Tensor:
        """(B,) float32 on the CPU: the classifier's logit for each text, at its last real token."""
        encoded = self.tokenizer(list(texts), padding=True, return_tensors="pt")
        logits = self.model(
            input_ids=encoded["input_ids"].to(self.device), attention_mask=encoded["attention_mask"].to(self.device)
        ).logits  # (B, 1)
        return logits[:, 0].float().cpu()  # (B,)


def load_reward_model(path: str | Path, *, dtype: str, device: torch.device | str, field: str) -> RewardModel:
    """The classifier and tokenizer at `path`, in `dtype` on `device`, frozen. `field` (e.g.
    `reward.terms[1].path`) names the setting in errors."""
    # PreTrainedTokenizerFast, as for the policy (models/loading.py): AutoTokenizer may build a
    # model family's own tokenizer class instead of the one saved in the folder.
    if not (Path(path) / "tokenizer.json").is_file():
        raise ValueError(
            f"{field}: {path} has no tokenizer.json; save the reward model's (fast) tokenizer "
            "beside it with tokenizer.save_pretrained"
        )
    tokenizer = read_tokenizer(path, field=field)
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is None:
            raise ValueError(
                f"{field}: the tokenizer at {path} has neither a pad nor an eos token; set "
                "tokenizer.pad_token before saving it"
            )
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "right"
    model = AutoModelForSequenceClassification.from_pretrained(str(path), dtype=DTYPES[dtype])
    if model.config.num_labels != 1:
        raise ValueError(
            f"{field}: the model at {path} has num_labels {model.config.num_labels}; a reward "
            "model gives one scalar per text (num_labels 1)"
        )
    # The classifier finds each row's last real token by the pad id: without one it would pool
    # the last column, a pad for every row but the longest.
    model.config.pad_token_id = tokenizer.pad_token_id
    model.to(device).eval().requires_grad_(False)
    return RewardModel(model, tokenizer, torch.device(device))
