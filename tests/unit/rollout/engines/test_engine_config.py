"""`rollout.engine` is parsed by the config class its engine type registers (`trajmesh.plugins.ENGINES`):
each type carries only the settings its engine reads, a setting of another type is rejected at load
time naming the key, sglang needs a url, and the default is the torch engine."""

from __future__ import annotations

from pathlib import Path

import pytest

from trajmesh import plugins
from trajmesh.config import ConfigError, EngineConfig, dump_config, load_config
from trajmesh.rollout.engines import HttpEngineConfig, SGLangEngineConfig, TorchEngineConfig
from trajmesh.rollout.engines.synthetic_engine import SyntheticEngineConfig


def _load_error(**engine: object) -> str:
    with pytest.raises(ConfigError) as err:
        load_config(overrides={f"rollout.engine.{k}": v for k, v in engine.items()})
    return str(err.value)


def test_default_engine_is_torch_with_its_defaults() -> None:
    eng = load_config().rollout.engine
    assert type(eng) is TorchEngineConfig
    assert eng.model_dump() == {"type": "torch", "request_timeout_s": 600.0, "url": None, "batch_window_ms": 2.0,
                                "startup_timeout_s": 120.0, "max_abort_retries": 5, "abort_backoff_s": 0.5}


def test_a_mapping_without_a_type_is_the_torch_engine() -> None:
    eng = load_config(overrides={"rollout.engine.url": "http://engine:30000"}).rollout.engine
    assert type(eng) is TorchEngineConfig and eng.url == "http://engine:30000"


@pytest.mark.parametrize(("settings", "cls"), [
    ({"type": "torch", "batch_window_ms": 0}, TorchEngineConfig),
    ({"type": "sglang", "url": "http://sglang:30000", "startup_timeout_s": 900}, SGLangEngineConfig),
    ({"type": "synthetic", "synthetic": {"decode_step_s": 0.02, "max_batch": 8}}, SyntheticEngineConfig),
])
def test_engine_config_is_parsed_by_its_types_class(settings: dict[str, object], cls: type[EngineConfig]) -> None:
    eng = load_config(overrides={f"rollout.engine.{k}": v for k, v in settings.items()}).rollout.engine
    assert type(eng) is cls and plugins.ENGINES[eng.type].config is cls
    if cls is SyntheticEngineConfig:
        assert isinstance(eng, SyntheticEngineConfig)
        assert (eng.synthetic.decode_step_s, eng.synthetic.max_batch) == (0.02, 8)
        assert not isinstance(eng, HttpEngineConfig)  # no url, batch window, startup wait, abort retries
    else:
        assert isinstance(eng, HttpEngineConfig) and "synthetic" not in eng.model_dump()
    if cls is SGLangEngineConfig:
        assert isinstance(eng, HttpEngineConfig) and (eng.url, eng.startup_timeout_s) == ("http://sglang:30000", 900)


def test_sglang_without_a_url_is_rejected_naming_the_key() -> None:
    msg = _load_error(type="sglang")
    assert "rollout.engine.url: Field required (add it)" in msg
    assert "rollout.engine.url" in _load_error(type="sglang", url="")
    assert plugins.engine("sglang").needs_url and not plugins.engine("torch").needs_url


def test_a_synthetic_timing_model_under_torch_is_rejected() -> None:
    msg = _load_error(type="torch", synthetic={"decode_step_s": 0.01})
    assert "rollout.engine.synthetic: engine type 'torch' has no such setting (a setting of synthetic)" in msg
    assert "remove it" in msg
    msg = _load_error(type="sglang", url="http://sglang:30000", synthetic={})
    assert "rollout.engine.synthetic: engine type 'sglang' has no such setting" in msg


def test_http_settings_under_synthetic_are_rejected_and_a_typo_has_no_owner() -> None:
    msg = _load_error(type="synthetic", url="http://x:1", batch_windw_ms=3)
    assert "rollout.engine.url: engine type 'synthetic' has no such setting (a setting of sglang, torch, vllm)" in msg
    assert "rollout.engine.batch_windw_ms: engine type 'synthetic' has no such setting (remove it" in msg


def test_unknown_engine_type_names_the_key_and_the_registered_ones() -> None:
    msg = _load_error(type="tensorrt")
    assert "rollout.engine.type: unknown rollout engine type 'tensorrt'" in msg
    assert "['sglang', 'synthetic', 'torch', 'vllm']" in msg


def test_every_registered_engine_config_defaults_to_its_type() -> None:
    assert set(plugins.ENGINES) == {"torch", "sglang", "synthetic", "vllm"}
    for type_, plugin in plugins.ENGINES.items():
        assert issubclass(plugin.config, EngineConfig)
        assert plugin.config.model_fields["type"].default == type_


def test_engine_config_survives_a_dump_and_reload(tmp_path: Path) -> None:
    cfg = load_config(overrides={"rollout.engine.type": "synthetic", "rollout.engine.synthetic.length_median": 40,
                                 "rollout.engine.request_timeout_s": 30})
    dump_config(cfg, tmp_path / "c.yaml")
    again = load_config(tmp_path / "c.yaml")
    assert isinstance(again.rollout.engine, SyntheticEngineConfig)
    assert again.rollout.engine.synthetic.length_median == 40 and again.rollout.engine.request_timeout_s == 30
    assert again.sha256() == cfg.sha256()


def test_trajmesh_envs_lists_each_engines_config_keys(capsys: pytest.CaptureFixture[str]) -> None:
    from trajmesh.run.cli import main

    assert main(["envs"]) == 0
    out = capsys.readouterr().out
    assert "config: SyntheticEngineConfig: request_timeout_s, synthetic\n" in out
    assert "config: SGLangEngineConfig: request_timeout_s, url, batch_window_ms," in out
    assert "config: TorchEngineConfig: request_timeout_s, url, batch_window_ms," in out
