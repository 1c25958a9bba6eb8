"""The prompt set the trainer draws from: the train rows rendered, tokenized and length-checked.

Prompts longer than `algorithm.max_prompt_length` tokens (after the template, with BOS where one
is added) are dropped, never cut (a cut prompt is a different question), counted and logged.
The sampler draws positions 0..len-1 among the kept prompts; `prompt_index` maps them back to
the row in the train files, and the row itself travels through the dock with its prompt
(`encoded_rows`, data/row_column.py), which is where the reward and an environment read it.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Sequence

from rldock.config.data import DataSpec
from rldock.runtime.chat.conversation import ChatRenderer
from rldock.runtime.data.rendering import prompt_messages, render_prompt, tokenize_prompts
from rldock.runtime.data.row_column import row_bytes
from rldock.runtime.data.rows import Example, PreferencePair, Row

logger = logging.getLogger(__name__)

# Every digit and the arithmetic signs are in a tiny model's vocabulary even when the train rows
# use only some of them, so a sampling model can still write any number.
ALPHABET = "0123456789+="
# A row's bytes in the dock past which the dataset warns (`PromptDataset.row_width`): the dock stores every
# sample's row as wide as the longest.
ROW_WIDTH_WARNING = 64 << 10


def tokenizer_corpus(rows: Sequence[Row], system_prompt: str | None = None) -> list[str]:
    """Texts to train the tiny model's tokenizer on: every character of the prompts and answers."""
    texts = [ALPHABET] + ([system_prompt] if system_prompt else [])
    for row in rows:
        prompt = row.prompt if isinstance(row.prompt, str) else "".join(m["content"] for m in row.prompt)
        texts.append(prompt + row.ground_truth)
    return texts


class PromptsTooLong(ValueError):
    """No prompt of a file set fits algorithm.max_prompt_length; the message names the field and the count."""


class PromptDataset:
    """Kept train prompts with their token ids, ground truths, data sources and extra info."""

    def __init__(
        self,
        rows: Sequence[Row],
        *,
        tokenizer,
        spec: DataSpec,
        max_prompt_length: int,
        conversation: ChatRenderer | None = None,
    ):
        """`conversation`: an agent job's renderer (the prompts describe the tools)."""
        texts = [
            render_prompt(
                row.prompt,
                tokenizer=tokenizer,
                chat_template=spec.chat_template,
                system_prompt=spec.system_prompt,
                where=f"{row.file} row {row.line}",
                conversation=conversation,
            )
            for row in rows
        ]
        if conversation is not None and conversation.preamble is not None:
            # a harness's first request (agent.harness_request): its ids as the gateway renders the request
            ids = [
                conversation.prompt_ids(prompt_messages(row.prompt, system_prompt=None, conversation=conversation))
                for row in rows
            ]
        else:
            ids = tokenize_prompts(tokenizer, texts, chat_template=spec.chat_template)
        keep = [i for i, row_ids in enumerate(ids) if len(row_ids) <= max_prompt_length]
        self.num_rows = len(rows)
        self.num_dropped = len(rows) - len(keep)
        if not keep:
            files = sorted({row.file for row in rows})
            raise PromptsTooLong(
                f"all {len(rows)} prompts of {files} are longer than algorithm.max_prompt_length="
                f"{max_prompt_length} tokens after the chat template (the shortest has {min(map(len, ids))}), "
                "so none could be drawn; raise it"
            )
        if self.num_dropped:
            longest = max(map(len, ids))
            logger.warning(
                "dropped %d of %d prompts longer than algorithm.max_prompt_length=%d tokens (the longest has %d)",
                self.num_dropped,
                len(rows),
                max_prompt_length,
                longest,
            )
        self._rows = list(rows)
        self._keep = keep  # position among kept prompts -> row in the train files
        self._texts = texts
        self._ids = ids

    def __len__(self) -> int:
        return len(self._keep)

    def prompt_index(self, position: int) -> int:
        """The train-file row of the kept prompt at `position`."""
        return self._keep[position]

    def prompt_ids(self, positions: Sequence[int]) -> list[list[int]]:
        """Token ids of the kept prompts at `positions` (each at most max_prompt_length long)."""
        return [self._ids[self._keep[p]] for p in positions]

    def examples(self, positions: Sequence[int]) -> list[Example]:
        out = []
        for p in positions:
            index = self._keep[p]
            row = self._rows[index]
            out.append(Example(self._texts[index], row.ground_truth, row.data_source, row.extra_info, index))
        return out

    def rows(self, positions: Sequence[int]) -> list[Row]:
        """The train-file rows of the kept prompts at `positions`."""
        return [self._rows[self._keep[p]] for p in positions]

    @functools.cached_property
    def _encoded(self) -> dict[int, bytes]:
        """Each kept row as the dock carries it, pickled once, when the driver first puts one (a command that
        only reads the prompts never pays for it)."""
        return {index: row_bytes(self._rows[index]) for index in self._keep}

    @functools.cached_property
    def row_width(self) -> int:
        """The dock's `prompt_row` width: the longest kept row's bytes. Every sample's row is stored that wide,
        so one long row (a long `extra_info`) widens them all: past ROW_WIDTH_WARNING a warning names it."""
        index, data = max(self._encoded.items(), key=lambda item: len(item[1]))
        if len(data) > ROW_WIDTH_WARNING:
            row = self._rows[index]
            logger.warning(
                "the longest train row (%s row %d) is %d KiB as the dock carries it, so every sample's dock row "
                "(prompt_row) is: the dock holds num_prompts_per_iteration x num_responses_per_prompt of them "
                "per bank; trim what the reward and environments do not read from the data files' rows",
                row.file,
                row.line,
                len(data) >> 10,
            )
        return len(data)

    def encoded_rows(self, positions: Sequence[int]) -> list[bytes]:
        """The train-file rows of the kept prompts at `positions` as the dock's `prompt_row` column holds them
        (data/row_column.py), each at most `row_width` bytes."""
        return [self._encoded[self._keep[p]] for p in positions]

    def demonstrations(self, positions: Sequence[int]) -> list[list[dict] | None]:
        """The demonstrations (data.demonstration_key) of the kept prompts at `positions`; None where a
        row has none."""
        return [self._rows[self._keep[p]].demonstration for p in positions]

    def preference_pairs(self, positions: Sequence[int]) -> list[PreferencePair]:
        """(prompt row, chosen, rejected) of the kept prompts at `positions` (DPO)."""
        pairs = []
        for p in positions:
            row = self._rows[self._keep[p]]
            if row.chosen is None or row.rejected is None:
                raise ValueError(
                    f"{row.file} row {row.line} has no preference pair; dpo needs "
                    "data.chosen_key and data.rejected_key (or the addition generator)"
                )
            pairs.append(PreferencePair(self._keep[p], row.chosen, row.rejected))
        return pairs
