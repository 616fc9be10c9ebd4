"""The prebuilt engine's launcher: llama-server's command line onto xllamacpp's parameters."""

from __future__ import annotations

import pytest

from llmgw.agent.engines import prebuilt_server as ps
from llmgw.model.engine_args import TAKES_VALUE


def test_every_flag_a_profile_may_pass_is_taken_or_refused_by_name() -> None:
    """A flag engine_args allows must not reach the prebuilt engine as 'unknown argument'."""
    for flag, takes_value in TAKES_VALUE.items():
        if flag in ps.UNSUPPORTED or flag in ps.DEVICE_FLAGS:
            continue
        known = ps.TAKES_VALUE if takes_value else ps.SWITCHES
        assert flag in known, f"{flag} is allowed by llmgw.model.engine_args but not mapped"


def test_the_agents_own_words_set_model_listen_address_key_and_metrics() -> None:
    argv = ["-m", "/w/m.gguf", "--host", "127.0.0.1", "--port", "8123", "--api-key", "k",
            "--metrics", "--threads-http", "80"]
    assert ps.parse(argv) == [
        ("model.path", "/w/m.gguf"), ("hostnames", ["127.0.0.1"]), ("port", 8123),
        ("api_keys", ["k"]), ("endpoint_metrics", True), ("n_threads_http", 80),
    ]


def test_nested_fields_and_one_flag_setting_two() -> None:
    sets = ps.parse(["--ctx-size", "512", "-t", "2", "--temp", "0.5", "-to", "30"])
    assert sets == [("n_ctx", 512), ("cpuparams.n_threads", 2), ("sampling.temp", 0.5),
                    ("timeout_read", 30), ("timeout_write", 30)]


def test_server_defaults_are_llama_servers_unless_given() -> None:
    assert ps._defaults([]) == [("n_parallel", 4), ("kv_unified", True)]
    assert ps._defaults([("n_parallel", 2)]) == [("n_parallel", 2)]


@pytest.mark.parametrize("argv, says", [
    (["--bogus"], "unknown argument '--bogus'"),
    (["--port"], "--port needs a value"),
    (["--port", "eighty"], "--port 'eighty'"),
    (["-dev", "CUDA0"], "runs on the CPU only"),
])
def test_what_it_cannot_take_is_refused_naming_the_word(argv: list[str], says: str) -> None:
    with pytest.raises(ps.UsageError, match=says):
        ps.parse(argv)


def test_apply_sets_dotted_fields_on_nested_objects() -> None:
    class Params:
        class Sampling:
            temp = 0.8

        def __init__(self) -> None:
            self.sampling = self.Sampling()
            self.n_ctx = 0

    params = Params()
    ps.apply(params, [("n_ctx", 512), ("sampling.temp", 0.1), ("", 1.0)])
    assert params.n_ctx == 512 and params.sampling.temp == 0.1
