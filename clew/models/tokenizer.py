"""A small byte-level BPE tokenizer for policies trained from scratch on the task's text.

Real Qwen tokenizers have ~150k entries, so the embedding and output layers of a 1-10M
parameter policy would be almost all vocabulary. A maze policy only ever reads and writes a
few hundred distinct words, so we train a BPE of about a thousand entries on the task's own
prompts instead. It is byte-level, so any string (newlines, unicode, text the corpus never
contained) still encodes and decodes exactly: unseen text costs more tokens, never an
unknown token.

The tokenizer carries Qwen2-VL's special tokens as single added tokens and a Qwen-style
chat template, so the rest of clew (and transformers' ``Qwen2VLProcessor`` logic, which
looks for ``<|image_pad|>``) treats it exactly like a real Qwen checkpoint's tokenizer.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

__all__ = [
    "BOS_TOKEN",
    "CHAT_TEMPLATE",
    "EOS_TOKEN",
    "IMAGE_TOKEN",
    "PAD_TOKEN",
    "SPECIAL_TOKENS",
    "VIDEO_TOKEN",
    "VISION_END_TOKEN",
    "VISION_START_TOKEN",
    "build_tokenizer",
    "default_corpus",
]

# Qwen2-VL names its end-of-document token <|endoftext|> and uses it as bos (config) and pad
# (tokenizer); <|im_end|> ends every chat turn, so generation must stop on it.
BOS_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<|endoftext|>"
EOS_TOKEN = "<|im_end|>"
VISION_START_TOKEN = "<|vision_start|>"
VISION_END_TOKEN = "<|vision_end|>"
IMAGE_TOKEN = "<|image_pad|>"
VIDEO_TOKEN = "<|video_pad|>"

# The full Qwen2-VL set, in Qwen's order. The box/quad/object tokens are unused by clew but
# cost only a row each and keep any Qwen prompt format a later step might borrow one token
# per marker. Listed first to the trainer, they get the ids 0..13 whatever the corpus.
SPECIAL_TOKENS: tuple[str, ...] = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    VISION_START_TOKEN,
    VISION_END_TOKEN,
    "<|vision_pad|>",
    IMAGE_TOKEN,
    VIDEO_TOKEN,
)

# Qwen2's pre-tokenizer split: single digits (so coordinates and counts compose), words with
# an optional leading space, punctuation runs, and whitespace runs that keep newlines
# (a WhitespaceSplit would silently drop the chat template's newlines).
_SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# Qwen2-VL's template, less its default "You are a helpful assistant." system turn: a policy
# trained from scratch gains nothing from it and would pay its tokens on every sample.
# Real Qwen checkpoints keep their own template; this one is only for clew-built models.
CHAT_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}"
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}<|im_end|>\n"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}"
    "{% if add_vision_id %}Picture {{ image_count.value }}: {% endif %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' or 'video' in content %}"
    "{% set video_count.value = video_count.value + 1 %}"
    "{% if add_vision_id %}Video {{ video_count.value }}: {% endif %}"
    "<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}"
    "{% endif %}{% endfor %}<|im_end|>\n"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

_ACTIONS = ("right", "up", "left", "down", "stop")

# The keyword action format's tags, kept whole (added tokens, matched before the BPE). A BPE
# trained on a small corpus otherwise learns merges across the tag boundary (">right",
# ">stop" but ">" + "down"), which splits the one decision of a turn over one or two tokens
# and makes the ">" that closes "</action>" look like the one that opens an action: a
# policy trained from scratch then keeps writing after "</action>". Whole tags make every
# reply "<action>", one action word, "</action>", "<|im_end|>". They are not special tokens:
# decoding keeps them, so the env reads the reply as written.
ACTION_TAG_TOKENS: tuple[str, ...] = ("<action>", "</action>")

_PROMPT_SENTENCES = (
    "You are navigating a maze.",
    "You are navigating a maze. Reach the goal and then stop.",
    "The image shows the maze: walls are dark, open cells are light, "
    "you are the circle and the goal is the square.",
    "Answer with one action inside tags, for example <action>up</action>.",
    "Valid actions are: right, up, left, down, stop.",
    "You moved right.",
    "You moved up.",
    "You moved left.",
    "You moved down.",
    "You hit a wall and did not move.",
    "You could not move there: a wall is in the way.",
    "The answer could not be parsed. Reply with <action>up</action> or another valid action.",
    "I could not parse your action.",
    "You reached the goal.",
    "You stopped before the goal.",
    "The episode is over.",
    "There are 10 turns remaining.",
    "1 turn remains.",
    "5 turns remain.",
    "Your position is (3, 4) and the goal is at (7, 7).",
    "What is your next action?",
    "Think step by step, then give your action.",
    "Previous action: up. Result: moved.",
    "Previous action: left. Result: hit a wall.",
)


def default_corpus() -> list[str]:
    """Generic maze-task text so a tokenizer is useful before the real env prompts exist.

    Callers should add their environment's actual prompts; this only makes sure the action
    words, the tagged and tuple action formats, digits and the usual feedback phrases become
    short token sequences.
    """
    corpus: list[str] = list(_PROMPT_SENTENCES)
    for index, action in enumerate(_ACTIONS):
        corpus.append(action)
        corpus.append(f" {action}")
        corpus.append(f"<action>{action}</action>")
        corpus.append(f"Action: {action}\n")
        if action == "stop":
            corpus.append("('stop', 'stop')")
        else:
            corpus.append(f"('move', {index})")
            corpus.append(f"You moved {action}.")
    corpus.append(" ".join(str(digit) for digit in range(10)))
    corpus.extend(f"{n} turns remain." for n in range(2, 41))
    corpus.extend(f"Position ({row}, {col})." for row in range(10) for col in range(10))
    return corpus


def _train_bpe(corpus: Iterable[str], vocab_size: int) -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_SPLIT_PATTERN), behavior="isolated"),
            # use_regex=False: the Split above already did the word splitting (as Qwen's does).
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        # min_frequency=2: a merge seen once is memorising, not compressing.
        min_frequency=2,
        show_progress=False,
        special_tokens=list(SPECIAL_TOKENS),
        # All 256 byte symbols, whether or not the corpus used them: this is what guarantees
        # that any text encodes.
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(corpus, trainer=trainer)
    return tokenizer


def build_tokenizer(
    corpus: Sequence[str] | None = None,
    vocab_size: int = 1024,
    *,
    include_default_corpus: bool = True,
) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE on ``corpus`` and wrap it as a Qwen-style chat tokenizer.

    ``vocab_size`` is a ceiling: training stops early when the corpus has no pair left that
    occurs twice, so a small corpus gives a smaller vocabulary. It counts the 14 special
    tokens, the 2 action tags and the 256 byte symbols, so it must be at least 272 + 1.

    Training is deterministic: the same corpus and ``vocab_size`` give the same vocabulary
    and merges, hence the same token ids, in every process.
    """
    minimum = len(SPECIAL_TOKENS) + len(ACTION_TAG_TOKENS) + 256 + 1
    if vocab_size < minimum:
        raise ValueError(
            f"vocab_size={vocab_size} is too small: a byte-level BPE with "
            f"{len(SPECIAL_TOKENS)} special tokens needs at least {minimum}"
        )
    texts: list[str] = list(default_corpus()) if include_default_corpus else []
    if corpus is not None:
        if isinstance(corpus, str):
            raise TypeError("corpus must be a list of strings, not one string")
        texts.extend(corpus)
    backend = _train_bpe(texts, vocab_size - len(ACTION_TAG_TOKENS))
    backend.add_tokens([AddedToken(t, special=False, normalized=False) for t in ACTION_TAG_TOKENS])
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        unk_token=None,
        additional_special_tokens=[t for t in SPECIAL_TOKENS if t not in (BOS_TOKEN, EOS_TOKEN)],
        chat_template=CHAT_TEMPLATE,
        # Qwen's tokenizer adds no bos: a chat starts with <|im_start|>.
        add_bos_token=False,
        add_eos_token=False,
        # Left padding so a batch of prompts ends at the same column for generation.
        padding_side="left",
        model_max_length=32768,
        clean_up_tokenization_spaces=False,
    )
    return tokenizer
