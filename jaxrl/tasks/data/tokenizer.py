"""Character-level tokenizer of the arithmetic task, built offline and cached as an HF tokenizer.

Every digit and operator is one token, so the model sees numbers digit by digit (BPE merges of digit
runs make arithmetic much harder to learn). The vocabulary is written out explicitly rather than
learned from a corpus: ids are then fixed forever (``PAD_ID`` = 0, ``EOS_ID`` = 1, ``BOS_ID`` = 2),
and checkpoints stay compatible with any later build. It is saved with ``save_pretrained`` so the
rest of jaxrl (and HF tools) load it with ``AutoTokenizer`` like any other tokenizer, offline.

The ``tools`` variant (the arithmetic task with the calculator, ``jaxrl.tasks.envs``) extends the
vocabulary: its first ids are the default's, then lowercase letters and a little punctuation (the
calculator's error observations) and the four tool tags, each one token. It is cached with its
own version marker, so a directory holds one variant and a switch rebuilds it. The ``countdown``
variant (``jaxrl.tasks.data.countdown``) adds the comma, colon and parentheses its prompts and
expressions use. The ``tools_chat`` variant is the tools one with a newline and ChatML's
``<|im_start|>`` / ``<|im_end|>`` (its EOS) and template, as an instruct model's tokenizer has them.
"""

from __future__ import annotations

import os
from pathlib import Path

import transformers
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

from jaxrl.tasks.envs.calculator import CALL_CLOSE, CALL_OPEN, RESULT_CLOSE, RESULT_OPEN

PAD, EOS, BOS, UNK = "<pad>", "<eos>", "<bos>", "<unk>"
SPECIAL_TOKENS = (PAD, EOS, BOS, UNK)
PAD_ID, EOS_ID, BOS_ID, UNK_ID = range(4)
CHARS = tuple("0123456789") + ("+", "-", "*", "=")
VOCAB: dict[str, int] = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + CHARS)}
# Written last into the cache: its presence means a complete save, its text a compatible one.
_MARKER = "jaxrl_tokenizer_version.txt"
_VERSION = "arith-char-v2:" + "".join(SPECIAL_TOKENS + CHARS)

# The tools variant: appended after the default ids, which stay as they are.
TOOL_CHARS = tuple("abcdefghijklmnopqrstuvwxyz") + (" ", ":", "(", ")", "/", ".")
TOOL_TOKENS = (CALL_OPEN, CALL_CLOSE, RESULT_OPEN, RESULT_CLOSE)  # the calculator's tags
TOOLS_VOCAB: dict[str, int] = {
  tok: i for i, tok in enumerate(SPECIAL_TOKENS + CHARS + TOOL_CHARS + TOOL_TOKENS)
}
_TOOLS_VERSION = "arith-tools-v1:" + "|".join(SPECIAL_TOKENS + CHARS + TOOL_CHARS + TOOL_TOKENS)
# The tools variant in a chat template (task.chat_template): the tools ids, then a newline and
# ChatML's two markers as special tokens, <|im_end|> the EOS (the end of every model turn), and
# ChatML's template (as Qwen2.5's, without its system prompt).
CHAT_START, CHAT_END = "<|im_start|>", "<|im_end|>"
CHAT_TOKENS = ("\n", CHAT_START, CHAT_END)
TOOLS_CHAT_VOCAB: dict[str, int] = {
  tok: i for i, tok in enumerate(SPECIAL_TOKENS + CHARS + TOOL_CHARS + TOOL_TOKENS + CHAT_TOKENS)
}
CHATML_TEMPLATE = (
  "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
  "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# A prompt's frame in that template, "<|im_start|>user\n" + "<|im_end|>\n<|im_start|>assistant\n":
# a token per character or marker.
CHAT_PROMPT_TOKENS = 19
_TOOLS_CHAT_VERSION = "arith-tools-chat-v1:" + "|".join(TOOLS_CHAT_VOCAB) + CHATML_TEMPLATE
# The countdown variant (jaxrl.tasks.data.countdown): the default's ids, then what its prompts and
# expressions add.
COUNTDOWN_CHARS = (",", ":", "(", ")")
COUNTDOWN_VOCAB: dict[str, int] = {
  tok: i for i, tok in enumerate(SPECIAL_TOKENS + CHARS + COUNTDOWN_CHARS)
}
_COUNTDOWN_VERSION = "countdown-char-v1:" + "|".join(SPECIAL_TOKENS + CHARS + COUNTDOWN_CHARS)
# variant -> (its vocabulary, its cache's version marker)
_VARIANTS = {
  "": (VOCAB, _VERSION),
  "tools": (TOOLS_VOCAB, _TOOLS_VERSION),
  "countdown": (COUNTDOWN_VOCAB, _COUNTDOWN_VERSION),
  "tools_chat": (TOOLS_CHAT_VOCAB, _TOOLS_CHAT_VERSION),
}
VARIANTS = tuple(_VARIANTS)


def vocab_size(variant: str = "") -> int:
  """The number of ids of a variant's vocabulary (the model's vocab_size for the built-in tasks)."""
  _version(variant)
  return len(_VARIANTS[variant][0])


def _raw_tokenizer() -> Tokenizer:
  """The `tokenizers` object: digits and punctuation isolated, looked up in the fixed vocabulary."""
  tok = Tokenizer(models.WordLevel(vocab=VOCAB, unk_token=UNK))
  # No whitespace splitting: a stray space or letter becomes <unk> instead of silently vanishing.
  tok.pre_tokenizer = pre_tokenizers.Sequence(
    [
      pre_tokenizers.Digits(individual_digits=True),
      pre_tokenizers.Punctuation(behavior="isolated"),
    ]
  )
  tok.decoder = decoders.Fuse()  # concatenate tokens: "1","2","5" -> "125", not "1 2 5"
  tok.add_special_tokens(list(SPECIAL_TOKENS))
  return tok


def _raw_char_tokenizer(vocab: dict[str, int]) -> Tokenizer:
  """Every character its own token."""
  tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
  tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
  tok.decoder = decoders.Fuse()
  tok.add_special_tokens(list(SPECIAL_TOKENS))
  return tok


def _raw_tools_tokenizer(vocab: dict[str, int] = TOOLS_VOCAB) -> Tokenizer:
  """The tools variant: every character its own token (letters included), the tags whole."""
  tok = _raw_char_tokenizer(vocab)
  # Added (not special) tokens: matched whole before the split, at their vocabulary ids, and kept
  # by any decode, which shows who called the tool and what it answered.
  tok.add_tokens([AddedToken(t, normalized=False, special=False) for t in TOOL_TOKENS])
  return tok


def _raw_tools_chat_tokenizer() -> Tokenizer:
  """The tools variant with ChatML's markers, special tokens as in Qwen's vocabulary."""
  tok = _raw_tools_tokenizer(TOOLS_CHAT_VOCAB)
  tok.pre_tokenizer = pre_tokenizers.Split(Regex("(.|\n)"), behavior="isolated")  # newlines too
  tok.add_special_tokens([CHAT_START, CHAT_END])
  return tok


def _eos(variant: str) -> str:
  """The EOS token of a variant: the chat variant's model ends its turns with <|im_end|>."""
  return CHAT_END if variant == "tools_chat" else EOS


def _version(variant: str) -> str:
  if variant not in VARIANTS:
    raise ValueError(f"tokenizer variant {variant!r} is not one of {VARIANTS}")
  return _VARIANTS[variant][1]


def _is_cached(cache_dir: Path, variant: str = "") -> bool:
  """True if cache_dir holds a complete save of this exact vocabulary."""
  marker = cache_dir / _MARKER
  return marker.is_file() and marker.read_text() == _version(variant)


def build_tokenizer(
  cache_dir: str | Path, variant: str = ""
) -> transformers.PreTrainedTokenizerFast:
  """The task tokenizer (``variant`` "tools": with the tool tags; "countdown": with its
  punctuation), built into ``cache_dir`` on first use and loaded from there afterwards."""
  cache_dir = Path(cache_dir)
  version = _version(variant)
  if not _is_cached(cache_dir, variant):
    raw = {
      "": _raw_tokenizer,
      "tools": _raw_tools_tokenizer,
      "countdown": lambda: _raw_char_tokenizer(COUNTDOWN_VOCAB),
      "tools_chat": _raw_tools_chat_tokenizer,
    }[variant]()
    fast = transformers.PreTrainedTokenizerFast(
      tokenizer_object=raw,
      pad_token=PAD,
      eos_token=_eos(variant),
      bos_token=BOS,
      unk_token=UNK,
      padding_side="left",
      clean_up_tokenization_spaces=False,
    )
    if variant == "tools_chat":
      fast.chat_template = CHATML_TEMPLATE
    cache_dir.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(cache_dir)
    tmp = cache_dir / f"{_MARKER}.{os.getpid()}.tmp"
    tmp.write_text(version)
    os.replace(tmp, cache_dir / _MARKER)
  tok = transformers.AutoTokenizer.from_pretrained(cache_dir)
  eos_id = _VARIANTS[variant][0][_eos(variant)]
  if (tok.pad_token_id, tok.eos_token_id, tok.bos_token_id) != (PAD_ID, eos_id, BOS_ID):
    raise RuntimeError(f"tokenizer in {cache_dir} has unexpected special ids; delete it to rebuild")
  return tok
