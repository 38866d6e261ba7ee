"""Daemon configuration: flags win over environment variables, which win over the YAML file."""

from __future__ import annotations

import pytest

from kpool_pd.decode_worker.daemon import OPTIONS as DECODE_OPTIONS
from kpool_pd.decode_worker.router import parse_targets
from kpool_pd.prefill_worker.daemon import OPTIONS as PREFILL_OPTIONS
from kpool_pd.runtime import SettingsError, load_settings, model_config


def _load(role, argv, env=None):
    return load_settings(role, PREFILL_OPTIONS if role == "prefill" else DECODE_OPTIONS, argv, description="t",
                         env=env or {})


def test_defaults_then_file_then_env_then_flags(tmp_path):
    path = tmp_path / "kpool.yaml"
    path.write_text("family: qsa\nlayers: 3\nnum-spec: 2\nport: 7000\nprefill:\n  num_blocks: 99\n  port: 7001\n"
                    "decode:\n  max-running: 5\n")
    assert _load("prefill", [])["family"] == "kpool"
    settings = _load("prefill", ["--config", str(path)])
    assert (settings["family"], settings["layers"], settings["num_spec"]) == ("qsa", 3, 2)
    assert (settings["port"], settings["num_blocks"]) == (7001, 99)  # the role's section wins over the top level
    env = {"KPOOLPD_LAYERS": "5", "KPOOLPD_CONFIG": str(path)}
    settings = _load("decode", [], env)
    assert (settings["layers"], settings["max_running"], settings["port"]) == (5, 5, 7000)
    settings = _load("decode", ["--layers", "7"], env)
    assert settings["layers"] == 7
    config = model_config(settings)
    assert config.num_layers == 7 and config.cache.family.value == "qsa"


def test_bad_values_name_the_option_and_the_source(tmp_path):
    with pytest.raises(SettingsError, match="layers from KPOOLPD_LAYERS"):
        _load("prefill", [], {"KPOOLPD_LAYERS": "many"})
    with pytest.raises(SettingsError, match="family from flag --family"):
        _load("prefill", ["--family", "dense"])
    path = tmp_path / "bad.yaml"
    path.write_text("layerz: 2\n")
    with pytest.raises(SettingsError, match="unknown option 'layerz'") as unknown:
        _load("decode", ["--config", str(path)])
    known = str(unknown.value).split("(known: ", 1)[1]  # the names as the README and the flags write them
    assert "metrics-port" in known and "max-prompt-tokens" in known and "_" not in known, known
    with pytest.raises(SettingsError, match="integrity from flag --integrity: expected a boolean"):
        _load("decode", ["--integrity", "maybe"])


def test_prefill_targets():
    assert parse_targets("a:1, dns:///prefill.svc:50051") == ("a:1", "dns:///prefill.svc:50051")
    for bad in ("", "host", "host:0", "dns:///name"):
        with pytest.raises(ValueError):
            parse_targets(bad)
    with pytest.raises(SettingsError, match="num-blocks from flag --num-blocks: expected an integer >= 0, got '-1'"):
        _load("decode", ["--num-blocks", "-1"])
    assert _load("decode", ["--num-blocks", "0"])["num_blocks"] == 0  # 0: sized from max-running
