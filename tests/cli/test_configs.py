"""Shipped configs: `nereus configs`, bare names for `nereus train`, and the wheel's package data."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile

import pytest
from typer.testing import CliRunner

from nereus.cli.app import app
from nereus.cli.configs import resolve_config, shipped_configs
from nereus.cli.train import default_config

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONFIGS = os.path.join(ROOT, "configs")

runner = CliRunner()


def test_configs_lists_each_shipped_config_with_its_first_comment_line():
    result = runner.invoke(app, ["configs"])
    assert result.exit_code == 0, result.output
    rows = {line.split()[0]: line for line in result.output.splitlines()}
    assert {"tiny_ppo", "tiny_grpo"} <= rows.keys()
    assert rows["tiny_ppo"].split(None, 1)[1].startswith("Default job: PPO")


def test_configs_path_prints_the_absolute_path_and_rejects_an_unknown_name():
    result = runner.invoke(app, ["configs", "--path", "tiny_grpo"])
    assert result.exit_code == 0, result.output
    assert result.output.strip() == os.path.join(CONFIGS, "tiny_grpo.yaml")
    result = runner.invoke(app, ["configs", "--path", "tiny_gpro"])
    assert result.exit_code == 2
    assert "unknown config 'tiny_gpro'" in result.output and "tiny_grpo" in result.output


def test_default_config_resolves_through_the_package():
    import nereus.configs

    assert os.path.dirname(nereus.configs.__file__) == CONFIGS
    assert str(default_config()) == os.path.join(CONFIGS, "tiny_ppo.yaml")
    assert shipped_configs()["tiny_ppo"] == default_config()


def test_a_bare_name_is_a_shipped_config_unless_such_a_file_exists(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    shipped = os.path.join(CONFIGS, "tiny_grpo.yaml")
    assert str(resolve_config("tiny_grpo")) == shipped
    assert str(resolve_config("tiny_grpo.yaml")) == shipped
    (tmp_path / "tiny_grpo.yaml").write_text("seed: 1\n")
    assert resolve_config("tiny_grpo.yaml").resolve() == tmp_path / "tiny_grpo.yaml"
    with pytest.raises(FileNotFoundError, match="no such file"):
        resolve_config("sub/tiny_ppo.yaml")  # a path is never looked up among the shipped ones


def test_train_with_an_unknown_config_is_a_one_line_error_listing_the_shipped_ones(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    result = runner.invoke(app, ["train", "tiny_gpro"])
    assert result.exit_code == 2
    assert result.output.count("\n") == 1
    assert "config 'tiny_gpro'" in result.output and "tiny_grpo, tiny_ppo" in result.output


@pytest.mark.timeout(120)
def test_an_installed_wheel_finds_its_configs_outside_the_checkout(tmp_path):
    # Build from a copy holding what pyproject.toml maps (no build/ or egg-info in the checkout).
    tomllib = pytest.importorskip("tomllib")
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        folders = set(tomllib.load(f)["tool"]["setuptools"]["package-dir"].values())
    src = tmp_path / "src"
    for name in folders:
        shutil.copytree(os.path.join(ROOT, name), src / name, ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(os.path.join(ROOT, name), src / name)
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    subprocess.run([*pip, "wheel", str(src), "--no-deps", "--no-build-isolation", "-w", str(tmp_path / "dist")], check=True)
    (wheel,) = (tmp_path / "dist").glob("nereus-*.whl")
    assert "nereus/configs/tiny_ppo.yaml" in zipfile.ZipFile(wheel).namelist()

    target, elsewhere = tmp_path / "target", tmp_path / "elsewhere"
    subprocess.run([*pip, "install", str(wheel), "--no-deps", "--no-index", "--target", str(target)], check=True)
    elsewhere.mkdir()
    env = {**os.environ, "PYTHONPATH": str(target)}  # first on sys.path, so the checkout is not imported
    code = "from nereus.cli.train import default_config; print(default_config())"
    out = subprocess.run([sys.executable, "-c", code], cwd=elsewhere, env=env, capture_output=True, text=True, check=True)
    path = out.stdout.strip()
    assert path.startswith(os.path.realpath(target) + os.sep) and os.path.isfile(path), out
