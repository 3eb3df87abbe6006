"""Build a tiny random-weight Llama with a real tokenizer, offline, into a folder.

Run with the vLLM venv's Python (it needs torch, transformers and tokenizers, which the project's
own venv does not have)::

    .venv-vllm/bin/python tests/realengine/build_tiny_llama.py OUT [--seed N --tokenizer-from DIR]

The tokenizer is a byte-level BPE trained here on text that ships with Python (the standard
library's module docstrings), so any prompt tokenizes without unknown tokens; it is saved as a
Hugging Face fast tokenizer with a chat template, so ``/v1/chat/completions`` works. The model is
``LlamaConfig`` tiny (hidden 128, 2 layers, 4 heads of 32: vLLM's CPU attention supports head
sizes 32, 64, 80, ... only, and 16 fails at the first request), its weights drawn from a fixed
seed, saved with ``save_pretrained`` in float32. Nothing is downloaded. The same Python, torch and
transformers give the same files; ``BUILD_ID`` below goes into ``crossflow_build.json`` so a
cache made by an older recipe is rebuilt.

``--seed N`` draws other weights for the same architecture; with ``--tokenizer-from`` the
tokenizer files are copied from another build, so the two models read the same token ids. A
decode engine that loads KV made by such a twin answers differently from its own prefill: that
is how the tests tell KV that really moved from KV that was recomputed.
"""

from __future__ import annotations

import argparse
import importlib
import json
import shutil
from pathlib import Path

BUILD_ID = "tiny-llama-v2"
VOCAB_SIZE = 2048
CORPUS_MODULES = (
    "argparse", "asyncio", "collections", "contextlib", "csv", "dataclasses", "datetime",
    "decimal", "email", "functools", "http.client", "inspect", "itertools", "json", "logging",
    "os", "pathlib", "pickle", "random", "re", "shutil", "socket", "sqlite3", "statistics",
    "string", "subprocess", "tarfile", "textwrap", "threading", "unittest", "urllib",
    "uuid", "zipfile",
)  # fmt: skip
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}{{ eos_token }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
SPECIAL = ["<unk>", "<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>"]


def corpus() -> list[str]:
    """Docstrings of standard-library modules and of their public members: a few MB of English
    and code that every Python carries."""
    texts: list[str] = []
    for name in CORPUS_MODULES:
        module = importlib.import_module(name)
        texts.append(module.__doc__ or "")
        for attr in sorted(dir(module)):
            doc = getattr(getattr(module, attr, None), "__doc__", None)
            if isinstance(doc, str) and not attr.startswith("_"):
                texts.append(doc)
    return [t for t in texts if t.strip()]


def build_tokenizer(out: Path) -> int:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        pad_token="</s>",
        chat_template=CHAT_TEMPLATE,
        model_max_length=2048,
    )
    fast.save_pretrained(out)
    return len(fast)


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def build_model(out: Path, vocab: int, seed: int) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=2048,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
        tie_word_embeddings=False,
        torch_dtype="float32",
    )
    model = LlamaForCausalLM(config).to(torch.float32)
    model.save_pretrained(out, safe_serialization=True)


def main() -> None:
    parser = argparse.ArgumentParser(description="Build the tiny random-weight Llama.")
    parser.add_argument("out", type=Path)
    parser.add_argument("--seed", type=int, default=0, help="Seed of the weights.")
    parser.add_argument("--tokenizer-from", type=Path, help="Copy this build's tokenizer.")
    args = parser.parse_args()
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    if args.tokenizer_from is not None:
        for name in TOKENIZER_FILES:
            shutil.copy2(args.tokenizer_from / name, out / name)
        vocab = json.loads((args.tokenizer_from / "crossflow_build.json").read_text())["vocab"]
    else:
        vocab = build_tokenizer(out)
    build_model(out, vocab, args.seed)
    stamp = {"build": BUILD_ID, "vocab": vocab, "seed": args.seed}
    (out / "crossflow_build.json").write_text(json.dumps(stamp))


if __name__ == "__main__":
    main()
