"""A task tokenizer padded to a real vocabulary's size with entries no text encodes to.

clew's tokenizer is a byte-level BPE of a few hundred entries trained on the task's text
(``clew.models.tokenizer``); Qwen's has 151,936 embedding rows. The output layer over the
vocabulary is then the largest matrix of the policy and the cross-entropy over it the
largest tensor of an update, which is what speed work at that scale must face. Training a
BPE of that size needs a corpus clew does not have offline, so the small BPE is kept and
its vocabulary extended with ``<|unused_N|>`` entries, ids ``N`` from the first free id on.

No merge produces them and the pre-tokenizer splits their text apart, so encoding any text
gives exactly the small tokenizer's ids; decoding one gives its own text. The special
tokens and action tags keep their ids.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

from transformers import AutoTokenizer, PreTrainedTokenizerBase

from clew.errors import ConfigError

__all__ = ["UNUSED_TOKEN", "pad_vocabulary"]

UNUSED_TOKEN = "<|unused_{}|>"


def pad_vocabulary(tokenizer: PreTrainedTokenizerBase, size: int) -> PreTrainedTokenizerBase:
    """``tokenizer`` with unused entries appended so that it has exactly ``size`` entries."""
    if size < len(tokenizer):
        raise ConfigError(
            f"a padded vocabulary of {size} entries cannot hold the tokenizer's "
            f"{len(tokenizer)}; give a size of at least {len(tokenizer)} (e.g. 151936, Qwen's)"
        )
    with tempfile.TemporaryDirectory() as folder:
        # Through the saved files, so every setting of the tokenizer (chat template, special
        # tokens, padding side) comes back as it was.
        tokenizer.save_pretrained(folder)
        path = Path(folder) / "tokenizer.json"
        data = json.loads(path.read_text())
        vocab: dict[str, int] = data["model"]["vocab"]
        # Added tokens outside the model's vocabulary would be renumbered after it once it
        # grows; entered in it under their own ids, they keep them.
        for added in data["added_tokens"]:
            vocab.setdefault(added["content"], added["id"])
        if sorted(vocab.values()) != list(range(len(vocab))):
            raise ConfigError("the tokenizer's ids are not contiguous; it cannot be padded")
        for index in range(len(vocab), size):
            vocab[UNUSED_TOKEN.format(index)] = index
        path.write_text(json.dumps(data, ensure_ascii=False))
        padded = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    if len(padded) != size:
        raise ConfigError(f"padding the vocabulary gave {len(padded)} entries, not {size}")
    return padded
