"""The option tables: the model options declared once (the daemons read them, ``kpool-pd up``
offers them with its own defaults, the launcher passes them on), the value parsers, and the
daemons' ``--help`` generated from the tables."""

from __future__ import annotations

import subprocess
import sys

import pytest

from kpool_pd.decode_worker.daemon import OPTIONS as DECODE_OPTIONS
from kpool_pd.cli import build_parser
from kpool_pd.kvcache import BlockOrder, CacheDtype, CacheFamily, PoolMode
from kpool_pd.model import ModelConfig
from kpool_pd.prefill_worker.daemon import OPTIONS as PREFILL_OPTIONS
from kpool_pd.runtime import (MODEL_OPTIONS, Option, SettingsError, load_settings, model_config, model_flags, model_settings,
                     parse_bool, parse_port, positive_float, positive_int)

CONFIGS = [
    pytest.param(ModelConfig.build(), id="defaults"),
    pytest.param(ModelConfig.build(family=CacheFamily.QSA, compress_ratio=8, num_spec=3, num_layers=3, seed=7), id="qsa"),
    pytest.param(ModelConfig.build(kpool=8, num_spec=1, block_size=256, seed=2), id="kpool8-block256"),
    pytest.param(ModelConfig.build(kpool=2, num_spec=3, pool_mode=PoolMode.KEEP_LAST, round_scale=False,
                                   block_order=BlockOrder.BLHNC, kernel_page_states=32), id="kpool-cache-options"),
    pytest.param(ModelConfig.build(family=CacheFamily.QSA, num_spec=3, qsa_dtype=CacheDtype.FP8,
                                   block_order=BlockOrder.BLHNC, cache_rope_positions=False), id="qsa-cache-options"),
]


@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("options", [PREFILL_OPTIONS, DECODE_OPTIONS], ids=["prefill", "decode"])
def test_model_flags_give_a_daemon_the_same_model(config, options):
    role = "prefill" if options is PREFILL_OPTIONS else "decode"
    settings = load_settings(role, options, model_flags(model_settings(config)), env={})
    assert model_config(settings) == config


def test_both_daemons_and_up_declare_the_model_options_from_one_table():
    names = [o.name for o in MODEL_OPTIONS]
    assert names == ["family", "layers", "kpool", "ratio", "num-spec", "block-size", "seed", "pool-mode", "round-scale",
                     "qsa-dtype", "block-order", "kernel-page-states", "cache-rope-positions"]
    for options in (PREFILL_OPTIONS, DECODE_OPTIONS):
        assert [o for o in options if o.name in names] == list(MODEL_OPTIONS)
    up = build_parser().parse_args(["up"])
    daemon = {o.key: o.default for o in MODEL_OPTIONS}
    assert {k: getattr(up, k) for k in daemon} == {**daemon, "num_spec": 3}  # up's own default: 3 drafts
    assert model_config(vars(up)) == ModelConfig.build(num_spec=3)
    assert model_flags(vars(up))[model_flags(vars(up)).index("--num-spec") + 1] == "3"


def test_up_flags_parse_like_the_daemons():
    args = build_parser().parse_args(["up", "--family", "qsa", "--ratio", "2", "--num-spec", "0", "--layers", "1",
                                      "--block-size", "64", "--seed", "5"])
    assert model_config(vars(args)) == ModelConfig.build(family=CacheFamily.QSA, compress_ratio=2, num_spec=0,
                                                   num_layers=1, block_size=64, seed=5)
    for bad in (["--family", "dense"], ["--layers", "two"]):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["up", *bad])


CACHE_FLAGS = ["--pool-mode", "keep-last", "--round-scale", "false", "--qsa-dtype", "fp8", "--block-order", "hnc",
               "--kernel-page-states", "32", "--cache-rope-positions", "false"]


def test_the_cache_options_reach_the_model_from_flags_env_yaml_and_up(tmp_path):
    want = ModelConfig.build(pool_mode=PoolMode.KEEP_LAST, round_scale=False, qsa_dtype=CacheDtype.FP8,
                             block_order=BlockOrder.BLHNC, kernel_page_states=32, cache_rope_positions=False)
    assert model_config(load_settings("prefill", PREFILL_OPTIONS, CACHE_FLAGS, env={})) == want
    env = {"KPOOLPD_POOL_MODE": "KEEP_LAST", "KPOOLPD_ROUND_SCALE": "0", "KPOOLPD_QSA_DTYPE": "fp8",
           "KPOOLPD_BLOCK_ORDER": "hnc", "KPOOLPD_KERNEL_PAGE_STATES": "32", "KPOOLPD_CACHE_ROPE_POSITIONS": "no"}
    assert model_config(load_settings("decode", DECODE_OPTIONS, [], env=env)) == want
    path = tmp_path / "cache.yaml"
    path.write_text("pool-mode: keep-last\nround-scale: false\nqsa-dtype: fp8\nblock-order: hnc\n"
                    "kernel-page-states: 32\ncache-rope-positions: false\n")
    assert model_config(load_settings("decode", DECODE_OPTIONS, ["--config", str(path)], env={})) == want
    up = vars(build_parser().parse_args(["up", "--num-spec", "0", *CACHE_FLAGS]))
    assert model_config(up) == want
    assert model_flags(up)[-12:] == CACHE_FLAGS  # what up passes its daemons


@pytest.mark.parametrize("flag,bad", [("--pool-mode", "mean"), ("--round-scale", "maybe"), ("--qsa-dtype", "fp16"),
                                      ("--block-order", "nch"), ("--kernel-page-states", "16"),
                                      ("--cache-rope-positions", "2")])
def test_a_bad_cache_option_names_itself_and_its_values(flag, bad):
    with pytest.raises(SettingsError, match=f"{flag[2:]} from flag {flag}: expected "):
        load_settings("prefill", PREFILL_OPTIONS, [flag, bad], env={})


def test_model_flags_need_every_model_option():
    values = model_settings(ModelConfig.build())
    del values["ratio"], values["seed"]
    with pytest.raises(KeyError, match=r"\['ratio', 'seed'\]"):
        model_flags(values)


@pytest.mark.parametrize("text,want", [("kpool", "kpool"), (" QSA ", "qsa")])
def test_the_family_option_gives_the_value(text, want):
    assert load_settings("decode", DECODE_OPTIONS, ["--family", text], env={})["family"] == want


@pytest.mark.parametrize("parse,good,bad", [
    pytest.param(parse_bool, [("yes", True), ("0", False), (True, True), (" Off ", False)], ["maybe", "2"], id="bool"),
    pytest.param(positive_int, [("3", 3), (1, 1)], ["0", "-2", "x", "1.5"], id="positive-int"),
    pytest.param(positive_float, [("0.5", 0.5), (2, 2.0)], ["0", "-1", "nan", "x"], id="positive-float"),
    pytest.param(parse_port, [("0", 0), ("-1", -1), ("65535", 65535)], ["65536", "-2", "http"], id="port"),
])
def test_value_parsers(parse, good, bad):
    for text, want in good:
        assert parse(text) == want
    for text in bad:
        with pytest.raises(ValueError):
            parse(text)


def test_an_option_name_is_dashed_words():
    for name in ("", "--port", "metrics_port"):
        with pytest.raises(ValueError, match="dashed words"):
            Option(name, str, "", "h")
    option = Option("metrics-port", parse_port, 9401, "h")
    assert (option.key, option.env) == ("metrics_port", "KPOOLPD_METRICS_PORT")


def test_a_yaml_value_of_the_wrong_kind_names_the_option_and_the_file(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("decode:\n  max-running: lots\n")
    with pytest.raises(SettingsError, match=f"max-running from config file {path}: "):
        load_settings("decode", DECODE_OPTIONS, ["--config", str(path)], env={})
    path.write_text("- a list\n")
    with pytest.raises(SettingsError, match="must hold a mapping"):
        load_settings("decode", DECODE_OPTIONS, ["--config", str(path)], env={})


@pytest.mark.parametrize("module,options", [("kpool_pd.prefill_worker", PREFILL_OPTIONS), ("kpool_pd.decode_worker", DECODE_OPTIONS)])
def test_a_daemons_help_lists_every_option_with_its_environment_variable(module, options):
    proc = subprocess.run([sys.executable, "-m", module, "--help"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    text = " ".join(proc.stdout.split())
    assert text.startswith(f"usage: kpool-pd {module.rpartition('.')[2].split('_')[0]} ")
    for option in options:
        assert f"--{option.name}" in text and option.env in text, option.name
    assert "one of kpool, qsa" in text and "(default 'json'; one of json, text;" in text
