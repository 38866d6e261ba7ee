"""The model options (``--family --layers --kpool --ratio --num-spec --block-size --seed``, and the
cache's options ``--pool-mode --round-scale --qsa-dtype --block-order --kernel-page-states
--cache-rope-positions``): one table that both daemons read, that ``kpool-pd up`` offers as flags and
that the launcher passes to the daemons it starts. Prefill and decode must agree on every one of them
but the block size, the block order and the kernel page, which only arrange the bytes (the
connector's handshake refuses any other difference)."""

from __future__ import annotations

import argparse
import logging
from collections.abc import Mapping
from typing import Any

import torch

from kpool_pd.kvcache import KERNEL_PAGE_STATES, BlockOrder, CacheDtype, CacheFamily, PoolMode
from kpool_pd.model import ModelConfig
from kpool_pd.runtime.options import Option, integer, nonnegative_int, one_of, parse_bool, positive_int

logger = logging.getLogger(__name__)

# each cache option's words on the command line, and what they mean
POOL_MODES = {"softmax": PoolMode.SOFTMAX, "keep-last": PoolMode.KEEP_LAST}
QSA_DTYPES = {"bf16": CacheDtype.BFLOAT16, "fp8": CacheDtype.FP8}
BLOCK_ORDERS = {"nhc": BlockOrder.BLNHC, "hnc": BlockOrder.BLHNC}


def _family(text: Any) -> str:
    return one_of(CacheFamily)(text).value


def _word_of(words: dict[str, Any]) -> Any:
    """A parser of one of ``words`` (case, surrounding space and ``_`` for ``-`` ignored); returns the word."""
    def parse(text: Any) -> str:
        if isinstance(text, bool):
            raise ValueError(f"expected one of {', '.join(words)}, got {text!r}")
        word = str(text).strip().lower().replace("_", "-")
        if word not in words:
            raise ValueError(f"expected one of {', '.join(words)}, got {text!r}")
        return word
    return parse


def _page_states(text: Any) -> int:
    value = integer(text)
    if value not in KERNEL_PAGE_STATES:
        raise ValueError(f"expected one of {', '.join(map(str, sorted(KERNEL_PAGE_STATES, reverse=True)))}, "
                         f"got {text!r}")
    return value


def _flag_bool(text: Any) -> str:
    """A boolean option kept as its flag text (``true``/``false``), so that it passes through ``model_flags``."""
    return "true" if parse_bool(text) else "false"


BASE_MODEL_OPTIONS: tuple[Option, ...] = (
    Option("family", _family, CacheFamily.KPOOL.value, "cache family", choices=tuple(f.value for f in CacheFamily)),
    Option("layers", positive_int, 2, "model layers"),
    Option("kpool", positive_int, 4, "tokens per kpool pool (kpool family)"),
    Option("ratio", positive_int, 4, "QSA compress ratio (qsa family)"),
    Option("num-spec", nonnegative_int, 0, "draft tokens per decode step"),
    Option("block-size", nonnegative_int, 0, "tokens per block (0: 256, or where the ring or the group does not divide 256, "
                                 "the smallest multiple of 128 that they divide)"),
    Option("seed", integer, 0, "seed of the synthetic model's weights"),
)
CACHE_OPTION_TABLE: tuple[Option, ...] = (  # the cache's options: each takes its default where a caller leaves it out
    Option("pool-mode", _word_of(POOL_MODES), "softmax", "how a kpool pool becomes one entry: the gated softmax "
           "pooling or the pool's last key", choices=tuple(POOL_MODES)),
    Option("round-scale", _flag_bool, "true", "round each kpool entry's fp8 scale up to a power of two",
           choices=("true", "false")),
    Option("qsa-dtype", _word_of(QSA_DTYPES), "bf16", "the QSA compressed key cache's dtype", choices=tuple(QSA_DTYPES)),
    Option("block-order", _word_of(BLOCK_ORDERS), "nhc", "a page's axes after block and layer: tokens, heads, "
           "channels (nhc, BLNHC) or heads first (hnc, BLHNC)", choices=tuple(BLOCK_ORDERS)),
    Option("kernel-page-states", _page_states, 64, "states of one kpool kernel page (a block of more holds several)",
           choices=tuple(str(p) for p in sorted(KERNEL_PAGE_STATES, reverse=True))),
    Option("cache-rope-positions", _flag_bool, "false", "keep each QSA ring row's packed MRoPE position (false, the "
           "seed's default: the text position stands for it; true: prompts may carry MRoPE positions)",
           choices=("false", "true")),
)
MODEL_OPTIONS: tuple[Option, ...] = BASE_MODEL_OPTIONS + CACHE_OPTION_TABLE
MODEL_KEYS = frozenset(option.key for option in MODEL_OPTIONS)
CACHE_OPTIONS = {option.key: option for option in CACHE_OPTION_TABLE}
REQUIRED_MODEL_KEYS = frozenset(option.key for option in BASE_MODEL_OPTIONS)


def model_config(settings: Mapping[str, Any]) -> ModelConfig:
    """The ModelConfig of the model options in ``settings`` (keys as in the table: ``num_spec``;
    other keys are ignored; a cache option left out takes its default, and its value is read as its
    flag would be: ``"keep-last"``, ``"true"`` or True). ``ValueError`` for a value or a combination the
    model refuses."""
    def cache_option(key: str) -> Any:
        option = CACHE_OPTIONS[key]
        return option.parse(settings.get(key, option.default))

    return ModelConfig.build(
        family=CacheFamily(settings["family"]), num_layers=settings["layers"], kpool=settings["kpool"],
        compress_ratio=settings["ratio"], num_spec=settings["num_spec"],
        block_size=settings["block_size"] or None, seed=settings["seed"],
        pool_mode=POOL_MODES[cache_option("pool_mode")], round_scale=parse_bool(cache_option("round_scale")),
        qsa_dtype=QSA_DTYPES[cache_option("qsa_dtype")], block_order=BLOCK_ORDERS[cache_option("block_order")],
        kernel_page_states=cache_option("kernel_page_states"),
        cache_rope_positions=parse_bool(cache_option("cache_rope_positions")),
    )


def cuda_graphs_serve(settings: Mapping[str, Any], device: Any,
                      families: tuple[CacheFamily, ...] = (CacheFamily.KPOOL,)) -> bool:
    """Whether a daemon's engine replays steps from CUDA graphs: ``cuda-graphs`` on, a CUDA device and a family
    of ``families``, those the daemon's graphs serve (prefill graphs: kpool; decode graphs: both; a daemon of
    another family runs eagerly, and says so)."""
    if not settings["cuda_graphs"] or torch.device(device).type != "cuda":
        return False
    family = model_config(settings).cache.family
    if family not in families:
        logger.info("steps run eagerly: these CUDA graphs serve the %s family, not %s",
                    " and ".join(f.value for f in families), family.value)
        return False
    return True


def model_settings(config: ModelConfig) -> dict[str, Any]:
    """The model options' settings that give ``config`` (``model_config`` of them equals it for
    every field the options cover)."""
    cache = config.cache
    return {"family": cache.family.value, "layers": cache.num_layers, "kpool": cache.kpool,
            "ratio": cache.compress_ratio, "num_spec": cache.num_spec, "block_size": cache.block_size,
            "seed": config.seed, "pool_mode": _word(POOL_MODES, cache.pool_mode),
            "round_scale": "true" if cache.round_scale else "false", "qsa_dtype": _word(QSA_DTYPES, cache.qsa_dtype),
            "block_order": _word(BLOCK_ORDERS, cache.order), "kernel_page_states": cache.kernel_page_states,
            "cache_rope_positions": "true" if cache.cache_rope_positions else "false"}


def _word(words: dict[str, Any], value: Any) -> str:
    """The command-line word of ``value`` (ValueError for a value no option gives: fp8_e4m3, auto)."""
    for word, meant in words.items():
        if meant is value:
            return word
    raise ValueError(f"{value!r} is not one of the options' values ({', '.join(words)})")


def model_flags(values: Mapping[str, Any]) -> list[str]:
    """The daemon flags that give every model option its value in ``values`` (keys as in the
    settings: ``num_spec``; other keys are ignored; a cache option left out takes its default):
    ``["--family", "kpool", "--layers", "2", ...]``. ``KeyError`` naming the other options missing
    from ``values``."""
    missing = sorted(REQUIRED_MODEL_KEYS - set(values))
    if missing:
        raise KeyError(f"model options missing: {missing}")
    return [text for option in MODEL_OPTIONS
            for text in (f"--{option.name}", _flag_text(values.get(option.key, option.default)))]


def _flag_text(value: Any) -> str:
    return ("true" if value else "false") if isinstance(value, bool) else str(value)


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
