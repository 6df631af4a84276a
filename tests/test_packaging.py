"""Installed names: models/ and pallas_kernels/ install under pagedjax, so a user project with
packages of its own named `models` or `pallas_kernels` still imports and runs pagedjax."""
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_pyproject_lists_every_package():
    tool = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    dirs = {name: ROOT / folder for name, folder in tool["package-dir"].items()}
    dirs["pagedjax"] = ROOT / "pagedjax"
    found = set()
    for name, folder in dirs.items():
        for init in folder.rglob("__init__.py"):
            parts = init.parent.relative_to(folder).parts
            found.add(".".join((name, *parts)))
    assert set(tool["packages"]) == found


def test_user_packages_named_models_do_not_collide(tmp_path):
    for name in ("models", "pallas_kernels"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "__init__.py").write_text("")
        (tmp_path / name / "config.py").write_text("HIDDEN = 64\n")
    code = ("import models.config, pallas_kernels; from pagedjax.engine.llm_engine import LLMEngine; "
            "from pagedjax.models.config import ModelConfig; import pagedjax.pallas_kernels.paged_attention.ops; "
            "assert models.config.HIDDEN == 64; print('ok')")
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]
