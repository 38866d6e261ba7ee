"""A user's working folder as it often is: a Hugging Face model folder named ``model`` beside packages
named as the product's layers, each of which raises on import (so anything of ours that reaches a
top-level ``runtime`` or ``kernels`` instead of ``kpool_pd.<layer>`` fails loudly)."""

from __future__ import annotations

from pathlib import Path

LAYERS = ("kvcache", "kernels", "model", "connector", "runtime", "prefill_worker", "decode_worker", "bench")
SHADOW_MESSAGE = "the user's own package was imported"


def shadowing_folder(root: Path) -> Path:
    """Fill ``root`` with the folders; returns it."""
    for name in LAYERS:
        package = root / name
        package.mkdir(exist_ok=True)
        (package / "__init__.py").write_text(f"raise ImportError({SHADOW_MESSAGE!r} + ': {name}')\n")
    (root / "model" / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]}\n')
    return root
