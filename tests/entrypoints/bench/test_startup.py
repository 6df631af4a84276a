"""`pagedjax bench startup`: its flags, and a run whose target fails (the child's own error is
reported, the JSON says which target and phase, the exit code is 1). A full cold/warm run takes
minutes: docs/benchmarks/cpu.md has one."""
from __future__ import annotations

import json

import pytest

from pagedjax.entrypoints.cli import main


@pytest.mark.parametrize("argv, message", [
    (["--only", "generate,bogus"], "--only takes a comma list of generate, serve, llm"),
    (["--phases", "hot"], "--phases takes a comma list of cold, warm"),
    (["--timeout", "0"], "--timeout must be positive"),
])
def test_bad_flags(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        main(["bench", "startup", *argv])
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_a_failing_target_is_reported(tmp_path, capsys):
    out = tmp_path / "startup.json"
    missing = tmp_path / "no-such-model"
    rc = main(["bench", "startup", "--only", "generate", "--phases", "cold,warm", "--model", str(missing),
               "--timeout", "120", "--output-json", str(out)])
    assert rc == 1
    res = json.loads(out.read_text())
    cold = res["targets"]["generate"]["cold"]
    assert "pagedjax generate exited 2 without output" in cold["error"] and str(missing) in cold["error"]
    assert "warm" not in res["targets"]["generate"]  # the warm phase is not tried after a failed cold one
    assert res["args"]["model"] == str(missing)
    text = capsys.readouterr().out
    assert "failed" in text and "generate: first token" in text
