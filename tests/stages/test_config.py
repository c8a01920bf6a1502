"""ServerConfig (stages/config.py): the model named after its directory, the port, --debug-faults
only on loopback, a role with its own section only, --max-body-mb. Pure."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.unit


def test_server_config_names_the_model_after_its_directory():
    from stages.config import ServerConfig
    from stages.engine.config import EngineConfig

    assert ServerConfig("colocated", EngineConfig(model="/models/qwen2-vl-tiny/")).model_name == "qwen2-vl-tiny"
    assert ServerConfig("colocated", EngineConfig(model="/m"), served_model_name="vl").model_name == "vl"
    assert ServerConfig("colocated", EngineConfig(model="/m")).host == "127.0.0.1"
    with pytest.raises(ValueError, match="--port"):
        ServerConfig("colocated", EngineConfig(model="/m"), port=70000)


def test_server_config_refuses_debug_faults_off_loopback_and_a_role_without_its_section():
    from stages.config import DisaggConfig, ServerConfig
    from stages.engine.config import EngineConfig

    engine = EngineConfig(model="/m")
    assert ServerConfig("colocated", engine, debug_faults=True).debug_faults
    assert ServerConfig("colocated", engine, host="::1", debug_faults=True).debug_faults
    with pytest.raises(ValueError, match="--debug-faults is refused on a server bound to '0.0.0.0'"):
        ServerConfig("colocated", engine, host="0.0.0.0", debug_faults=True)
    with pytest.raises(ValueError, match="a decode server needs DisaggConfig"):
        ServerConfig("decode", engine)
    with pytest.raises(ValueError, match="a colocated server takes no DisaggConfig"):
        ServerConfig("colocated", engine, disagg=DisaggConfig())
    with pytest.raises(ValueError, match="--max-body-mb"):
        ServerConfig("colocated", engine, max_body_mb=0)
