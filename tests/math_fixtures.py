"""A tiny math checkpoint directory as a user would download it, built offline: a random Qwen2 model
saved by transformers in 2 safetensors shards, a BPE tokenizer with a ChatML chat template, a
generation_config.json with two stop ids; and tiny math datasets in jsonl.
"""

from __future__ import annotations

import json
import os
import pathlib

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
import transformers  # noqa: E402
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers  # noqa: E402

CHATML = (
  "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
  "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# Llama 3 style: the chat template itself starts with the BOS token.
LLAMA3 = (
  "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>"
  "\n\n{{ m['content'] }}<|eot_id|>{% endfor %}{% if add_generation_prompt %}"
  "<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
LLAMA3_SPECIALS = [
  "<|begin_of_text|>",
  "<|end_of_text|>",
  "<|start_header_id|>",
  "<|end_header_id|>",
  "<|eot_id|>",
]
PROBLEMS = [
  ("What is 2 + 3?", "5"),
  ("Compute 7 * 6.", "42"),
  ("What is half of 1?", "\\frac{1}{2}"),
  ("Solve x + 4 = 10 for x.", "6"),
  ("What is 10 - 13?", "-3"),
  ("What is 0.5 + 0.25?", "0.75"),
  ("What is the square root of 16?", "4"),
  ("What is 3^2?", "9"),
  ("What is 100 / 4?", "25"),
  ("Evaluate 2 * (3 + 4).", "14"),
  ("What is 1/3 + 1/3?", "\\frac{2}{3}"),
  ("What is 9 - 9?", "0"),
]


def make_tokenizer(style: str = "chatml") -> transformers.PreTrainedTokenizerFast:
  """A byte-level BPE tokenizer trained on the problems: ChatML (Qwen) or Llama 3 style."""
  corpus = [q + " " + a for q, a in PROBLEMS] * 4 + [
    "Please reason step by step, and put your final answer within \\boxed{}.",
    "The answer is \\boxed{5}. user assistant system",
  ]
  raw = Tokenizer(models.BPE(unk_token=None, byte_fallback=False))
  raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  raw.decoder = decoders.ByteLevel()
  specials = SPECIALS if style == "chatml" else LLAMA3_SPECIALS
  raw.train_from_iterator(
    corpus,
    trainers.BpeTrainer(
      vocab_size=400, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    ),
  )
  if style == "chatml":
    tok = transformers.PreTrainedTokenizerFast(
      tokenizer_object=raw, eos_token="<|im_end|>", pad_token="<|endoftext|>"
    )
    tok.chat_template = CHATML
  else:  # no pad token, like Llama 3
    tok = transformers.PreTrainedTokenizerFast(
      tokenizer_object=raw, bos_token="<|begin_of_text|>", eos_token="<|eot_id|>"
    )
    tok.chat_template = LLAMA3
  return tok


@torch.no_grad()
def make_checkpoint(out_dir, seed: int = 0) -> pathlib.Path:
  """Save the tiny model + tokenizer + generation config into ``out_dir`` (2 weight shards)."""
  out = pathlib.Path(out_dir)
  tok = make_tokenizer()
  config = transformers.Qwen2Config(
    vocab_size=len(tok),
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=512,
    tie_word_embeddings=False,
    use_sliding_window=False,
    dtype="float32",
    eos_token_id=tok.convert_tokens_to_ids("<|im_end|>"),
    pad_token_id=tok.pad_token_id,
  )
  torch.manual_seed(seed)
  model = transformers.Qwen2ForCausalLM(config).eval()
  model.save_pretrained(out, max_shard_size="100KB")
  tok.save_pretrained(out)
  stops = [tok.convert_tokens_to_ids("<|im_end|>"), tok.convert_tokens_to_ids("<|endoftext|>")]
  (out / "generation_config.json").write_text(json.dumps({"eos_token_id": stops}))
  assert (out / "model.safetensors.index.json").exists()
  return out


def write_jsonl(path, rows) -> pathlib.Path:
  path = pathlib.Path(path)
  path.write_text("".join(json.dumps(r) + "\n" for r in rows))
  return path


def make_math_data(out_dir) -> tuple[pathlib.Path, pathlib.Path]:
  """train.jsonl (the problems twice, with a level field) and val.jsonl (the first six)."""
  out = pathlib.Path(out_dir)
  out.mkdir(parents=True, exist_ok=True)
  train = [
    {"problem": q, "answer": a, "level": f"L{1 + i % 2}"} for i, (q, a) in enumerate(PROBLEMS * 2)
  ]
  val = [{"problem": q, "answer": a, "level": "L1"} for q, a in PROBLEMS[:6]]
  return write_jsonl(out / "train.jsonl", train), write_jsonl(out / "val.jsonl", val)
