"""kv_connector_extra_config is checked at start-up: defaults, every key, and a clear error
naming the key for an unknown key or a value of the wrong kind."""

from __future__ import annotations

import pytest

from hybrid_pd.connector.vllm import ConnectorOptions


def test_defaults():
    assert ConnectorOptions.parse(None) == ConnectorOptions.parse({}) == ConnectorOptions()
    o = ConnectorOptions()
    assert (o.control_host, o.control_port, o.peers, o.secret_file) == ("127.0.0.1", 0, (), None)
    assert (o.lease_s, o.keep_wait_s, o.timeout_s, o.scatter_gather) == (120.0, 10.0, 30.0, True)


def test_every_key():
    o = ConnectorOptions.parse(
        {
            "control_host": "127.0.0.2",
            "control_port": 9100,
            "peers": ["127.0.0.1:9100", "[::1]:9101"],
            "secret_file": "/run/secret",
            "lease_s": 5,
            "keep_wait_s": 0,
            "timeout_s": 2.5,
            "scatter_gather": False,
        }
    )
    assert o == ConnectorOptions(
        "127.0.0.2", 9100, ("127.0.0.1:9100", "[::1]:9101"), "/run/secret", 5.0, 0.0, 2.5, False
    )
    assert isinstance(o.lease_s, float)


@pytest.mark.parametrize(
    "extra, named",
    [
        ({"scatter_gather": "false"}, "scatter_gather must be true or false, not 'false'"),
        ({"scatter_gather": 0}, "scatter_gather must be true or false"),
        ({"control_port": "9100"}, "control_port must be an integer port"),
        ({"control_port": 70000}, "control_port must be an integer port"),
        ({"control_port": True}, "control_port must be an integer port"),
        ({"peers": "127.0.0.1:9100"}, "peers must be a list"),
        ({"peers": ["127.0.0.1"]}, "peers must be a list"),
        ({"peers": [9100]}, "peers must be a list"),
        ({"lease_s": 0}, "lease_s must be a positive number of seconds"),
        ({"timeout_s": "30"}, "timeout_s must be a positive number"),
        ({"timeout_s": float("nan")}, "timeout_s must be a positive number"),
        ({"keep_wait_s": -1}, "keep_wait_s must be seconds >= 0"),
        ({"control_host": ""}, "control_host must be a non-empty string"),
        ({"secret_file": 3}, "secret_file must be a non-empty string"),
        ({"scatter_gatehr": False}, "unknown key(s) 'scatter_gatehr'"),
    ],
)
def test_bad_values_name_the_key(extra, named):
    with pytest.raises(ValueError) as err:
        ConnectorOptions.parse(extra)
    assert named in str(err.value)
    assert "kv_connector_extra_config" in str(err.value)
