"""A user's working folder as it often is: a Hugging Face model folder named ``model`` beside packages
named as the product's layers (``runtime``, ``kernels``, ...). They are plain, empty packages, as a user's
own would be: code of ours that reached a top-level ``runtime`` or ``kernels`` instead of
``kpool_pd.<layer>`` would find none of its names there and fail (``cannot import name ... from
'runtime'``), and libraries that probe for a PyPI package of that name (transformers looks for
``kernels``) see one without a version and pass it by, as they would in the user's folder."""

from __future__ import annotations

from pathlib import Path

LAYERS = ("kvcache", "kernels", "model", "connector", "runtime", "prefill_worker", "decode_worker", "bench")
SHADOW_SIGNS = tuple(f"from '{name}'" for name in LAYERS)  # how Python names a module in a failed import


def shadowing_folder(root: Path) -> Path:
    """Fill ``root`` with the folders; returns it."""
    for name in LAYERS:
        package = root / name
        package.mkdir(exist_ok=True)
        (package / "__init__.py").write_text(f'"""A user\'s own {name} package, not kpool-pd\'s."""\n')
    (root / "model" / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]}\n')
    return root


def shadowed(text: str) -> list[str]:
    """The lines of ``text`` (a log, an error) where an import reached one of the user's packages."""
    return [line for line in text.splitlines() if any(sign in line for sign in SHADOW_SIGNS)]
