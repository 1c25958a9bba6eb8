"""The job's data: files (or a generator that writes them) loaded into rows, prompts rendered and
tokenized into the `PromptDataset` the trainer draws from with a `PromptSampler`.

Flow: `prepare_data_files` (generate if configured) -> `load_rows` -> `PromptDataset` (chat
template, tokens, drop over-long prompts). Only the driver loads the rows: each sample's row travels
through the dock with its prompt (data/row_column.py), where the reward and an environment read it.
"""

from rldock.runtime.data.dataset import ALPHABET, PromptDataset, tokenizer_corpus
from rldock.runtime.data.files import Columns, columns_of, load_rows, val_columns
from rldock.runtime.data.generators import GENERATORS, DataFiles, generate_files, prepare_data_files
from rldock.runtime.data.rendering import render_prompt, tokenize_prompts
from rldock.runtime.data.rows import Example, GeneratedRows, PreferencePair, Row
from rldock.runtime.data.sampler import PromptSampler

__all__ = [
    "ALPHABET",
    "GENERATORS",
    "Columns",
    "DataFiles",
    "Example",
    "GeneratedRows",
    "PreferencePair",
    "PromptDataset",
    "PromptSampler",
    "Row",
    "columns_of",
    "generate_files",
    "load_rows",
    "prepare_data_files",
    "render_prompt",
    "tokenize_prompts",
    "tokenizer_corpus",
    "val_columns",
]
