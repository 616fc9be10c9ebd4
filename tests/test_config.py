"""llmgw.config: typed server.yaml and agent.yaml; a bad value is refused at load, named."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from llmgw import config as cfg
from llmgw.http1.limits import Limits

# server.yaml as the previous release wrote it (control plane step, then the mirror block);
# its header comment shortened.
PREVIOUS_SERVER_YAML = """# The control plane of this host, written once by llmgw.
admin_listen: 127.0.0.1:9090
agent_listen: :7443
gateway_listen: :8080
state_dir: /tmp/h/lib/llmgw
advertise: 192.0.2.2
tls:
  ca: /tmp/h/etc/pki/ca.pem
  cert: /tmp/h/etc/pki/server.pem
  key: /tmp/h/etc/pki/server-key.pem
node_timeout_s: 30.0
tokens: []

# The model mirror on this machine, added by llmgw (pytest provision/).
mirror:
  api: http://127.0.0.1:8082
  listen: ':8081'
"""

PREVIOUS_AGENT_YAML = """server: https://192.0.2.2:7443
node_id: vm
state_dir: /tmp/h/lib/llmgw-agent
tls:
  ca: /tmp/h/etc/pki/ca.pem
  cert: /tmp/h/etc/agent.pem
  key: /tmp/h/etc/agent-key.pem
labels:
  llmgw.control-plane: 'true'
heartbeat_s: 5.0
engine:
  llama_server: ''
  cache_dir: /root/.cache/llmgw
  source: ''
  version: ''
"""


def _write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_files_the_previous_release_wrote_load_unchanged(tmp_path: Path) -> None:
    server = cfg.load_server(_write(tmp_path, "server.yaml", PREVIOUS_SERVER_YAML))
    assert server.mirror.api == "http://127.0.0.1:8082" and server.tls.key.endswith("key.pem")
    agent = cfg.load_agent(_write(tmp_path, "agent.yaml", PREVIOUS_AGENT_YAML))
    assert agent.labels == {"llmgw.control-plane": "true"} and agent.heartbeat_s == 5.0


def test_render_then_load_is_the_same_config(tmp_path: Path) -> None:
    server = cfg.ServerConfig(tokens=["t1"], mirror=cfg.MirrorRef(api="http://x:1"))
    path = _write(tmp_path, "server.yaml", cfg.render(server, "header"))
    assert cfg.load_server(path) == server
    assert path.read_text().startswith("# header\n")


def test_the_http_limits_are_the_cores_limits_and_agent_http_keeps_its_own_defaults(
        tmp_path: Path) -> None:
    """gateway_http and agent_http are read into the HTTP core's Limits itself (its one
    definition); keys left out of agent_http keep the agent API's defaults (AGENT_LIMITS),
    which differ from the core's (the control: else the two would read the same), and a
    rendered file loads back the same."""
    server = cfg.load_server(_write(tmp_path, "server.yaml", "gateway_http: {max_headers: 50}\n"
                                                             "agent_http: {max_headers: 50}\n"))
    assert server.gateway_http == Limits(max_headers=50)
    assert server.agent_http == replace(cfg.AGENT_LIMITS, max_headers=50)
    assert server.agent_http.keep_alive_s != server.gateway_http.keep_alive_s
    path = _write(tmp_path, "rendered.yaml", cfg.render(server, "header"))
    assert cfg.load_server(path) == server


def test_a_numeric_token_is_refused_naming_the_key(tmp_path: Path) -> None:
    path = _write(tmp_path, "server.yaml", "tokens: [12345]\n")
    with pytest.raises(cfg.ConfigError) as e:
        cfg.load_server(path)
    message = str(e.value)
    assert str(path) in message and "tokens.0 is 12345" in message
    assert "valid string" in message


@pytest.mark.parametrize("text, said", [
    ("admin_listen: 9090\n", "admin_listen is 9090"),
    ("admin_listen: localhost\n", "has no port"),
    ("node_timeout_s: -1\n", "node_timeout_s is -1: Input should be greater than 0"),
    ("tls: {ca: x, cret: y}\n", "tls.cret is not a known key (known here: ca, cert, key)"),
    ("admin_lisen: x\n", "admin_lisen is not a known key"),
    ("- a\n- b\n", "should be a mapping"),
    ("gateway_routing: random\n", "gateway_routing is 'random': Input should be 'balanced' or "
                                  "'round-robin'"),
    ("gateway_http: {max_head_byte: 10}\n", "gateway_http.max_head_byte is not a known key "
                                           "(known here: max_head_bytes, max_headers,"),
    ("agent_http: {keep_alive_s: 0}\n", "agent_http.keep_alive_s is 0: Input should be greater "
                                        "than 0"),
])
def test_wrong_values_are_refused_with_key_value_and_what_is_allowed(
        tmp_path: Path, text: str, said: str) -> None:
    with pytest.raises(cfg.ConfigError) as e:
        cfg.load_server(_write(tmp_path, "server.yaml", text))
    assert said in str(e.value)


def test_agent_labels_become_strings_and_a_numeric_version_is_refused(tmp_path: Path) -> None:
    agent = cfg.load_agent(_write(tmp_path, "agent.yaml", "labels: {gpu: true, rack: 7}\n"))
    assert agent.labels == {"gpu": "True", "rack": "7"}
    with pytest.raises(cfg.ConfigError, match="engine.version is 0.3"):
        cfg.load_agent(_write(tmp_path, "agent.yaml", "engine: {version: 0.3}\n"))


def test_engine_cuda_off_written_as_the_docs_say_loads_as_off(tmp_path: Path) -> None:
    """`cuda: off` under `engine:` (unquoted, as the GPU engine's failure tells a person to
    write it; YAML reads false) is off, and so is `prebuilt: off`; the control: `cuda: on`
    (true) is refused, naming what is allowed."""
    agent = cfg.load_agent(_write(tmp_path, "agent.yaml", "engine:\n  cuda: off\n"
                                                          "  prebuilt: off\n"))
    assert (agent.engine.cuda, agent.engine.prebuilt) == ("off", "off")
    with pytest.raises(cfg.ConfigError, match="engine.cuda is True: Input should be 'auto' or "
                                              "'off'"):
        cfg.load_agent(_write(tmp_path, "agent.yaml", "engine: {cuda: on}\n"))


def test_an_empty_file_is_the_defaults_and_a_missing_one_says_how_to_make_it(tmp_path) -> None:
    assert cfg.load_server(_write(tmp_path, "server.yaml", "")) == cfg.ServerConfig()
    with pytest.raises(cfg.ConfigError, match="run `pytest provision/`"):
        cfg.load_server(tmp_path / "nope.yaml")


def test_the_control_plane_refuses_to_start_on_a_numeric_token(tmp_path: Path) -> None:
    """The service loads the same model: it exits at once naming the key, never a 500 later."""
    import subprocess
    import sys

    path = _write(tmp_path, "server.yaml", "tokens: [12345]\n")
    proc = subprocess.run([sys.executable, "-m", "llmgw", "server", "--config", str(path)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0
    assert "tokens.0 is 12345" in proc.stderr, proc.stderr


def test_gateway_keys_and_tls_default_to_todays_gateway_and_refuse_half_a_setting(
        tmp_path: Path) -> None:
    path = tmp_path / "server.yaml"
    path.write_text("tokens: ['t']\n")
    old = cfg.load_server(path)
    assert old.gateway_keys == "" and (old.gateway_tls.cert, old.gateway_tls.key) == ("", "")
    path.write_text("gateway_keys: required\ngateway_tls: {cert: /c.pem, key: /k.pem}\n")
    assert cfg.load_server(path).gateway_tls.key == "/k.pem"
    for text, said in (("gateway_keys: yes\n", "gateway_keys is True"),
                       ("gateway_keys: always\n", "'required'"),
                       ("gateway_tls: {cert: /c.pem}\n", "needs both cert and key")):
        path.write_text(text)
        with pytest.raises(cfg.ConfigError, match=said):
            cfg.load_server(path)
