"""Runs a cases script of tests/parallel/ in a fresh process (it sets up its own virtual CPU
devices) and returns the JSON it prints on its `RESULT ` line."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path


def run_cases(script: Path, out_dir: Path, timeout: int = 900) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    proc = subprocess.run([sys.executable, str(script), str(out_dir)], capture_output=True, text=True, env=env,
                          timeout=timeout)
    line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
    assert proc.returncode == 0 and line, f"{script.name} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return json.loads(line[len("RESULT "):])
