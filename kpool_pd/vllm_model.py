"""`kpool-pd vllm-model DIR`: a small model folder that ``vllm serve`` runs on a CPU in seconds, for trying a
vLLM PD deployment before a real model is at hand (the README's vLLM commands use it).

The folder holds the 2-layer Llama of the tests and benches (``kpool_pd.bench.vllm_engines.TINY_LLAMA``: its config
and seeded weights, ``model.safetensors``) and a byte-level tokenizer of its own (``tokenizer.json``: the
256 bytes and ``<unk>``, ``<s>``, ``</s>``, no merges, so any text encodes, one token a byte; and
``tokenizer_config.json`` with a plain chat template), so completions and chat both work with text. The
weights are random: the model's words are noise, but greedy decoding is deterministic, so a PD pair and one
server alone give the same tokens. Needs ``safetensors`` and ``tokenizers`` (vLLM brings both).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

SPECIAL_TOKENS = ("<unk>", "<s>", "</s>")  # ids 0, 1, 2: the model's bos_token_id 1 and eos_token_id 2
CHAT_TEMPLATE = ("{% for message in messages %}<s>{{ message['role'] }}: {{ message['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}assistant:{% endif %}")


def write_tokenizer(folder: Path, max_length: int) -> int:
    """``tokenizer.json`` and ``tokenizer_config.json`` of a byte-level tokenizer in ``folder``; its
    vocabulary size (the special tokens and the 256 bytes)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    vocab = {token: index for index, token in enumerate(SPECIAL_TOKENS)}
    for char in sorted(pre_tokenizers.ByteLevel.alphabet()):
        vocab[char] = len(vocab)
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([AddedToken(token, special=True) for token in SPECIAL_TOKENS])
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "unk_token": "<unk>", "bos_token": "<s>", "eos_token": "</s>",
        "model_max_length": max_length, "chat_template": CHAT_TEMPLATE}, indent=1))
    return len(vocab)


def write_runnable_model(folder: Path) -> Path:
    """The model folder (config, weights, tokenizer) in ``folder``, made if missing; ValueError for a
    ``folder`` that is a file or a folder holding something else."""
    from kpool_pd.bench.vllm_engines import TINY_LLAMA, write_model

    if folder.exists() and (not folder.is_dir() or any(p.name not in _FILES for p in folder.iterdir())):
        raise ValueError(f"{folder} is {'a file' if not folder.is_dir() else 'a folder with other files in it'}: "
                         f"give a new or empty folder (or one this command wrote)")
    write_model(folder)
    vocab = write_tokenizer(folder, TINY_LLAMA["max_position_embeddings"])
    if vocab > TINY_LLAMA["vocab_size"]:
        raise ValueError(f"the tokenizer's {vocab} tokens do not fit the model's vocabulary of {TINY_LLAMA['vocab_size']}")
    return folder


_FILES = {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kpool-pd vllm-model", description=__doc__.split("\n\n")[0])
    parser.add_argument("folder", type=Path, help="where to write the model (a new or empty folder)")
    args = parser.parse_args(argv)
    try:
        folder = write_runnable_model(args.folder)
    except (ValueError, ImportError) as error:
        print(f"kpool-pd vllm-model: error: {error}", file=sys.stderr)
        return 2
    print(f"wrote a 2-layer Llama with a byte-level tokenizer to {folder} "
          f"(vllm serve {folder} ... --served-model-name tiny-llama)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
