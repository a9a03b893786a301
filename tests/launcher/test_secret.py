"""The control-plane secret: where `serve` and the worker process take it from, what they
refuse, and that a worker started by `start_worker` never has it on its command line."""

from __future__ import annotations

import grpc
import pytest

from hybrid_pd import roles
from hybrid_pd.launcher import cli
from hybrid_pd.launcher.local import SECRET_ENV, _secret_out_of_argv, start_worker
from hybrid_pd.launcher.serve_config import ServeConfig, resolve_secret
from hybrid_pd.workers import main as worker_main

CLUSTER = "127.0.0.1:6379"  # never dialled: every case here fails or resolves before ray.init


@pytest.fixture
def secret_file(tmp_path):
    path = tmp_path / "secret"
    path.write_text("  from-file\n")
    return str(path)


def test_env_name_is_one_name():
    assert SECRET_ENV == worker_main.SECRET_ENV == "HYBRID_PD_SECRET"


@pytest.mark.parametrize("embedded", [True, False])
def test_precedence_flag_then_file_then_env(secret_file, embedded):
    env = {SECRET_ENV: "from-env"}
    assert resolve_secret("flag", secret_file, env, embedded=embedded) == "flag"
    assert resolve_secret(None, secret_file, env, embedded=embedded) == "from-file"
    assert resolve_secret(None, None, env, embedded=embedded) == "from-env"
    assert resolve_secret(None, None, {SECRET_ENV: " from-env \n"}, embedded=embedded) == (
        "from-env"
    )


def test_embedded_makes_a_fresh_secret_when_none_is_given():
    a = resolve_secret(None, None, {}, embedded=True)
    b = resolve_secret(None, None, {SECRET_ENV: ""}, embedded=True)  # empty counts as unset
    assert a and b and a != b and len(a) >= 40


def test_cluster_without_secret_is_refused_unless_insecure():
    with pytest.raises(ValueError, match="needs a control-plane secret"):
        resolve_secret(None, None, {}, embedded=False)
    with pytest.raises(ValueError, match="--insecure"):
        ServeConfig(address=CLUSTER).resolved({})
    assert resolve_secret(None, None, {}, embedded=False, insecure=True) is None
    assert ServeConfig(address=CLUSTER, insecure=True).resolved({}).secret is None
    # A secret given anyway wins over --insecure.
    assert ServeConfig(address=CLUSTER, insecure=True).resolved({SECRET_ENV: "e"}).secret == "e"


def test_missing_or_empty_secret_file_is_an_error(tmp_path):
    with pytest.raises(ValueError, match="no such file"):
        resolve_secret(None, str(tmp_path / "absent"), {SECRET_ENV: "e"}, embedded=True)
    empty = tmp_path / "empty"
    empty.write_text(" \n")
    with pytest.raises(ValueError, match="is empty"):
        resolve_secret(None, str(empty), {SECRET_ENV: "e"}, embedded=True)
    with pytest.raises(ValueError, match="empty"):
        resolve_secret("  ", None, {}, embedded=True)


def test_serve_config_resolved(secret_file):
    cfg = ServeConfig(secret_file=secret_file).resolved({SECRET_ENV: "e"})
    assert (cfg.secret, cfg.secret_file) == ("from-file", None)
    assert cfg.worker_config("decode", "tiny").secret == "from-file"
    assert cfg.resolved({}).secret == "from-file"  # settled: resolving again keeps it
    assert "from-file" not in repr(cfg)
    generated = ServeConfig().resolved({})
    assert generated.secret and generated.worker_config("prefill", "tiny").secret


def test_yaml_keys(tmp_path, secret_file):
    path = tmp_path / "serve.yaml"
    path.write_text(f"address: {CLUSTER}\ninsecure: true\nsecret-file: {secret_file}\n")
    cfg = ServeConfig.from_yaml(path, insecure=None, secret=None)  # unset flags keep the file's
    assert cfg.insecure and cfg.secret_file == secret_file
    assert cfg.resolved({}).secret == "from-file"
    path.write_text("insecure: 1\n")
    with pytest.raises(ValueError, match="insecure"):
        ServeConfig.from_yaml(path)


def test_serve_cli_refuses_a_cluster_without_secret(monkeypatch, capsys):
    monkeypatch.delenv(SECRET_ENV, raising=False)
    assert cli.main(["serve", "--address", CLUSTER]) == 2
    err = capsys.readouterr().err
    assert "needs a control-plane secret" in err and "--insecure" in err


def test_serve_cli_secret_file_errors(tmp_path, capsys):
    assert cli.main(["serve", "--secret-file", str(tmp_path / "absent")]) == 2
    assert "no such file" in capsys.readouterr().err


def test_serve_cli_flags_reach_the_deployment(monkeypatch, tmp_path, secret_file):
    """--secret-file / --insecure / env on the command line and in a YAML file, as the
    Deployment receives them (a stand-in Deployment: no Ray)."""
    seen = []

    class Stop(Exception):
        pass

    def fake_deployment(config, **_):
        seen.append(config)
        raise Stop

    import hybrid_pd.launcher.serve as serve

    monkeypatch.setattr(serve, "Deployment", fake_deployment)
    monkeypatch.setattr("signal.signal", lambda *_: None)
    monkeypatch.setenv(SECRET_ENV, "from-env")

    def run(*argv):
        with pytest.raises(Stop):
            cli.main(["serve", *argv])
        return seen.pop()

    assert run("--address", CLUSTER).secret == "from-env"
    assert run("--address", CLUSTER, "--secret-file", secret_file).secret == "from-file"
    assert run("--secret", "flag", "--secret-file", secret_file).secret == "flag"
    monkeypatch.delenv(SECRET_ENV)
    assert run("--address", CLUSTER, "--insecure").secret is None
    # A secret on the command line replaces the YAML file's.
    path = tmp_path / "serve.yaml"
    path.write_text(f"address: {CLUSTER}\nsecret: in-yaml\ninsecure: true\n")
    assert run("--config", str(path)).secret == "in-yaml"
    assert run("--config", str(path), "--secret-file", secret_file).secret == "from-file"
    assert run("--config", str(path), "--ucx-tls", "tcp,self").ucx_tls == "tcp,self"


def test_worker_main_precedence(secret_file, monkeypatch):
    given = worker_main.given_secret
    monkeypatch.setenv(SECRET_ENV, "from-env")
    assert given("flag", secret_file) == "flag"
    assert given(None, secret_file) == "from-file"
    assert given(None, None) == "from-env"
    monkeypatch.delenv(SECRET_ENV)
    assert given(None, None) is None
    args = worker_main.parse_args(["--role", "decode", "--secret-file", secret_file])
    assert args.secret_file == secret_file and args.secret is None


def test_worker_main_rejects_a_bad_secret_file(tmp_path, capsys):
    rc = roles.main(["--role", "decode", "--secret-file", str(tmp_path / "absent")])
    assert rc == 2 and "no such file" in capsys.readouterr().err


def test_start_worker_takes_secret_out_of_argv():
    assert _secret_out_of_argv(("--model", "m", "--secret", "s", "--threads", "1")) == (
        ["--model", "m", "--threads", "1"],
        "s",
    )
    assert _secret_out_of_argv(("--secret=a=b",)) == ([], "a=b")
    assert _secret_out_of_argv(("--secret-file", "f")) == (["--secret-file", "f"], None)
    with pytest.raises(ValueError):
        _secret_out_of_argv(("--secret",))


@pytest.mark.slow
def test_started_worker_keeps_its_secret_off_the_command_line(tmp_path, monkeypatch):
    from hybrid_pd.engine.tiny import resolve_model
    from hybrid_pd.proxy.worker_client import WorkerClient

    monkeypatch.setenv("HYBRID_PD_CACHE", str(tmp_path))
    monkeypatch.setenv(SECRET_ENV, "the-parents-secret")  # not inherited by the worker
    path = resolve_model("tiny")
    secret = "s3cret-" + "x" * 20
    args = ["--model", str(path), "--kv-memory", "8MiB", "--threads", "1"]
    # The way older callers pass it (`--secret VALUE`): it still leaves argv.
    worker = start_worker("decode", *args, "--secret", secret, timeout=120)
    try:
        assert worker.secret == secret
        pid = worker.proc.pid
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmdline = f.read()
        assert secret.encode() not in cmdline and b"--secret" not in cmdline
        with open(f"/proc/{pid}/environ", "rb") as f:
            environ = f.read().split(b"\0")
        assert f"{SECRET_ENV}={secret}".encode() in environ
        assert b"the-parents-secret" not in b"\0".join(environ)
        # ... and the worker does require it.
        with pytest.raises(grpc.RpcError) as e:
            WorkerClient(worker.address, timeout_s=30).stats()
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert WorkerClient(worker.address, secret=secret, timeout_s=30).stats()["role"] == (
            "decode"
        )
    finally:
        worker.stop()
