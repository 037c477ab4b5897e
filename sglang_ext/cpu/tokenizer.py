"""A tokenizer folder for CPU servers of synthetic checkpoints.

The synthetic Kimi-K3 checkpoint (k3nvfp4.checkpoint.synthetic) ships stand-ins for the
release's tokenizer and processor code, and a vocabulary of 256. ``write_k3_text_processor``
writes what SGLang's Kimi-K3 server loads instead (``--tokenizer-path``): a word-level tokenizer
over ``TINY_VOCAB`` (250 ids) with a chat template, and the text-only processor of
processing_tiny_k3.py. Every token decodes to a distinct string, so top_logprobs keys never
collide; decoding joins tokens with spaces ("Answer: B w017").
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

WORDS = tuple(f"w{i:03d}" for i in range(240))  # the tiny tokenizer's words: distinct, readable
# The tokens of an answer line, "Answer: X" (the extraction of sglang_ext/ab/prompts.py reads the
# last one), after WORDS: ids 245..249, so that WORDS keep their ids.
ANSWER_WORDS = ("Answer:", "A", "B", "C", "D")
SPECIALS = ("<s>", "</s>", "<unk>", "<|user|>", "<|assistant|>")
TINY_VOCAB = SPECIALS + WORDS + ANSWER_WORDS  # token ids in this order
_PROCESSOR = Path(__file__).resolve().parent / "processing_tiny_k3.py"


def write_tiny_tokenizer(out: Path) -> int:
    """A word-level tokenizer over WORDS and ANSWER_WORDS (unknown words -> <unk>) with a chat
    template, saved into ``out``; returns the vocabulary size (250)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(TINY_VOCAB)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(list(SPECIALS))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    fast.chat_template = ("{% for m in messages %}{% if m['role'] == 'user' %}<|user|> {{ m['content'] }} "
                          "{% else %}<|assistant|> {{ m['content'] }} </s> {% endif %}{% endfor %}"
                          "{% if add_generation_prompt %}<|assistant|>{% endif %}")
    fast.save_pretrained(out)
    return len(vocab)


def write_k3_text_processor(out: Path) -> Path:
    """A --tokenizer-path folder for a synthetic K3 checkpoint: the tiny tokenizer (its 250 ids
    fit the synthetic vocabulary of 256) and the text-only processor SGLang's Kimi-K3
    multimodal processor needs. Returns ``out`` (created)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    write_tiny_tokenizer(out)
    shutil.copy(_PROCESSOR, out)
    (out / "processor_config.json").write_text(json.dumps(
        {"processor_class": "TinyK3Processor", "auto_map": {"AutoProcessor": "processing_tiny_k3.TinyK3Processor"}}))
    return out
