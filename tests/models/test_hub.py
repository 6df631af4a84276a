"""A model given as a Hugging Face id resolves to its snapshot in the local Hugging Face cache
(HF_HUB_CACHE, HF_HOME), and says where it looked when it is not there. No network: a
download either is refused (HF_HUB_OFFLINE) or goes to a closed local port."""
from __future__ import annotations

import pytest

from pagedjax.models.hub import hub_cache_dir, is_repo_id, resolve_model_dir

REPO = "some-org/some-model"
REV = "a" * 40


def fake_snapshot(cache, repo: str = REPO, files=("config.json", "tokenizer.json", "model.safetensors")):
    """A Hugging Face cache entry for `repo`: models--org--name/snapshots/REV/<files>, refs/main."""
    entry = cache / ("models--" + repo.replace("/", "--"))
    snapshot = entry / "snapshots" / REV
    snapshot.mkdir(parents=True)
    for name in files:
        (snapshot / name).write_text("{}")
    (entry / "refs").mkdir()
    (entry / "refs" / "main").write_text(REV)
    return snapshot


@pytest.fixture
def env(monkeypatch, tmp_path):
    for name in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HOME", "XDG_CACHE_HOME", "HF_HUB_OFFLINE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.chdir(tmp_path)  # no relative path named like the ids below
    return monkeypatch


def test_an_id_resolves_to_its_cached_snapshot(env, tmp_path):
    snapshot = fake_snapshot(tmp_path / "hub-cache")
    env.setenv("HF_HUB_CACHE", str(tmp_path / "hub-cache"))
    env.setenv("HF_HUB_OFFLINE", "1")
    assert resolve_model_dir(REPO) == snapshot


def test_hf_home_is_honored(env, tmp_path):
    snapshot = fake_snapshot(tmp_path / "home" / "hub")
    env.setenv("HF_HOME", str(tmp_path / "home"))
    env.setenv("HF_HUB_OFFLINE", "1")
    assert hub_cache_dir() == tmp_path / "home" / "hub"
    assert resolve_model_dir(REPO) == snapshot
    env.setenv("HF_HUB_CACHE", str(tmp_path / "elsewhere"))  # HF_HUB_CACHE comes first
    assert hub_cache_dir() == tmp_path / "elsewhere"


def test_a_local_directory_wins_over_an_id(env, tmp_path):
    local = tmp_path / "some-org" / "some-model"
    local.mkdir(parents=True)
    fake_snapshot(tmp_path / "hub-cache")
    env.setenv("HF_HUB_CACHE", str(tmp_path / "hub-cache"))
    assert resolve_model_dir(REPO) == local.relative_to(tmp_path)


def test_a_snapshot_without_weights_is_not_taken_for_the_model(env, tmp_path):
    """A tokenizer-only download (AutoTokenizer.from_pretrained) leaves a snapshot with no
    weights: offline, the error says so instead of a loader failure on missing files."""
    fake_snapshot(tmp_path / "hub-cache", files=("config.json", "tokenizer.json"))
    env.setenv("HF_HUB_CACHE", str(tmp_path / "hub-cache"))
    env.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(FileNotFoundError, match="has a snapshot of it without weights"):
        resolve_model_dir(REPO)


def test_offline_and_not_cached_says_where_it_looked(env, tmp_path):
    env.setenv("HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    env.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(FileNotFoundError) as e:
        resolve_model_dir("other-org/missing")
    message = str(e.value)
    for part in ("'other-org/missing' is not a local directory", f"Hugging Face cache at {tmp_path / 'empty-cache'}",
                 "HF_HUB_OFFLINE is set", "hf download other-org/missing", "pass a local model directory"):
        assert part in message, (part, message)


def test_a_failed_download_says_why_and_what_to_do(env, tmp_path):
    from huggingface_hub import constants

    env.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")  # nothing listens there: refused at once
    env.setenv("HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    with pytest.raises(FileNotFoundError) as e:
        resolve_model_dir("other-org/missing")
    message = str(e.value)
    assert "downloading it failed" in message and str(tmp_path / "empty-cache") in message
    assert "hf download other-org/missing" in message


def test_paths_are_not_ids(env, tmp_path):
    assert is_repo_id("HuggingFaceTB/SmolLM2-135M-Instruct") and is_repo_id("gpt2")
    for path in ("/nonexistent/dir", "./model", "~/model", "a/b/c", "../x", "org/..", "model."):
        assert not is_repo_id(path), path
    with pytest.raises(FileNotFoundError, match="model directory '/nonexistent/dir' does not exist"):
        resolve_model_dir("/nonexistent/dir")


def test_the_engine_names_the_model_by_its_id(env, tmp_path):
    from pagedjax.engine.engine_stats import model_name

    assert model_name(REPO) == REPO and model_name(None) == "SmolLM2-135M-Instruct"
    (tmp_path / "local-model").mkdir()
    assert model_name(str(tmp_path / "local-model")) == "local-model"
