"""The CLI builds its EngineConfig once from the flags and the environment (fastremover.cli.engine_config): a bad
value stops the command with one line and exit code 2 before any input is read; `info` prints the configuration the
environment gives; `-v` logs the configuration a command runs with."""

import json

import pytest

from fastremover.cli import main


def test_a_bad_environment_value_fails_before_anything_is_read(monkeypatch, capsys, tmp_path):
    monkeypatch.setenv("FASTREMOVER_FUSED_FFN1", "yes")
    rc = main(["remove", str(tmp_path / "missing.mp4"), "--mask", str(tmp_path / "missing-mask.mp4"),
               "-o", str(tmp_path / "out.mp4"), "--model", "random", "--preset", "tiny"])
    err = capsys.readouterr().err
    assert rc == 2 and "FASTREMOVER_FUSED_FFN1='yes'" in err, err
    assert "missing.mp4" not in err  # refused before the inputs were looked at


def test_bench_reads_the_same_config(monkeypatch, capsys):
    monkeypatch.setenv("FASTREMOVER_FUSED_FFN1", "2")
    rc = main(["bench", "--model", "random", "--preset", "tiny", "--no-save"])
    assert rc == 2 and "FASTREMOVER_FUSED_FFN1='2'" in capsys.readouterr().err


def test_info_prints_the_engine_config_with_its_sources(monkeypatch, capsys):
    monkeypatch.setenv("FASTREMOVER_FUSED_FFN1", "0")
    monkeypatch.setenv("FASTREMOVER_UPCONV_TUNE", "0")
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    assert "engine config (defaults + environment):" in out
    assert "linears.fused_ffn1: off  (FASTREMOVER_FUSED_FFN1)" in out
    assert "tuning.upconv_tune: False  (FASTREMOVER_UPCONV_TUNE)" in out
    assert "attention.backend: auto  (--attention)" in out
    assert "parallel.world_size: None  (--gpus)" in out and "parallel.mode: none  (--parallel)" in out


@pytest.mark.slow
def test_verbose_remove_logs_the_engine_config(tmp_path, capsys):
    """-v: the input configuration (debug record) and, after the run, the resolved engine with that input inside."""
    assert main(["demo", "-o", str(tmp_path / "d"), "--frames", "5", "--width", "32", "--height", "32",
                 "--quiet"]) == 0
    capsys.readouterr()
    rc = main(["-v", "remove", str(tmp_path / "d" / "input.mp4"), "--mask", str(tmp_path / "d" / "mask.mp4"),
               "-o", str(tmp_path / "out.mp4"), "--model", "random", "--preset", "tiny", "--steps", "1",
               "--device", "cpu", "--quiet", "--attention", "sdpa"])
    err = capsys.readouterr().err
    assert rc == 0, err
    line = next(l for l in err.splitlines() if l.startswith("fastremover: debug: engine config: "))
    config = json.loads(line.split("engine config: ", 1)[1])
    assert config["attention"] == {"backend": "sdpa", "keep": None, "window": None}
    assert config["device"] == "cpu" and config["mode"] == "auto"
