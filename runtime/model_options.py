"""The model options (``--family --layers --kpool --ratio --num-spec --block-size --seed``): one
table that both daemons read, that ``kpool-pd up`` offers as flags and that the launcher passes
to the daemons it starts. Prefill and decode must agree on every one of them (the connector's
handshake refuses a layout mismatch)."""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from typing import Any

from kvcache import CacheFamily
from model import ModelConfig
from runtime.options import Option, integer, nonnegative_int, one_of, positive_int


def _family(text: Any) -> str:
    return one_of(CacheFamily)(text).value


MODEL_OPTIONS: tuple[Option, ...] = (
    Option("family", _family, CacheFamily.KPOOL.value, "cache family", choices=tuple(f.value for f in CacheFamily)),
    Option("layers", positive_int, 2, "model layers"),
    Option("kpool", positive_int, 4, "tokens per kpool pool (kpool family)"),
    Option("ratio", positive_int, 4, "QSA compress ratio (qsa family)"),
    Option("num-spec", nonnegative_int, 0, "draft tokens per decode step"),
    Option("block-size", nonnegative_int, 0, "tokens per block (0: 256, or where the ring or the group does not divide 256, "
                                 "the smallest multiple of 128 that they divide)"),
    Option("seed", integer, 0, "seed of the synthetic model's weights"),
)
MODEL_KEYS = frozenset(option.key for option in MODEL_OPTIONS)


def model_config(settings: Mapping[str, Any]) -> ModelConfig:
    """The ModelConfig of the model options in ``settings`` (keys as in the table: ``num_spec``;
    other keys are ignored). ``ValueError`` for a combination the model refuses."""
    return ModelConfig.build(
        family=CacheFamily(settings["family"]), num_layers=settings["layers"], kpool=settings["kpool"],
        compress_ratio=settings["ratio"], num_spec=settings["num_spec"],
        block_size=settings["block_size"] or None, seed=settings["seed"],
    )


def model_settings(config: ModelConfig) -> dict[str, Any]:
    """The model options' settings that give ``config`` (``model_config`` of them equals it for
    every field the options cover)."""
    cache = config.cache
    return {"family": cache.family.value, "layers": cache.num_layers, "kpool": cache.kpool,
            "ratio": cache.compress_ratio, "num_spec": cache.num_spec, "block_size": cache.block_size,
            "seed": config.seed}


def model_flags(values: Mapping[str, Any]) -> list[str]:
    """The daemon flags that give every model option its value in ``values`` (keys as in the
    settings: ``num_spec``; other keys are ignored): ``["--family", "kpool", "--layers", "2", ...]``.
    ``KeyError`` naming the options missing from ``values``."""
    missing = sorted(MODEL_KEYS - set(values))
    if missing:
        raise KeyError(f"model options missing: {missing}")
    return [text for option in MODEL_OPTIONS for text in (f"--{option.name}", str(values[option.key]))]


def add_model_arguments(parser: argparse.ArgumentParser, *, defaults: Mapping[str, Any] | None = None,
                        skip: tuple[str, ...] = ()) -> None:
    """Add the model options to ``parser`` as typed flags with their defaults (``defaults``,
    keyed like the settings, replaces some), leaving out the options named in ``skip``."""
    defaults = dict(defaults or {})
    unknown = (set(defaults) | set(skip)) - MODEL_KEYS
    if unknown:
        raise ValueError(f"not model options: {sorted(unknown)}")
    for option in MODEL_OPTIONS:
        if option.key in skip:
            continue
        default = defaults.get(option.key, option.default)
        parser.add_argument(f"--{option.name}", type=str if option.choices else option.parse, choices=option.choices,
                            default=default, help=f"{option.help} (default {default})")
