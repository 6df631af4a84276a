"""The Tunix GRPO example of docs/design/integration.md (linked from the README) runs as
written (a fresh process, as a user pastes it)."""
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_readme_tunix_example_runs(default_model_path, tmp_path):
    readme = (ROOT / "docs" / "design" / "integration.md").read_text()
    code = re.search(r"<!-- tunix-example -->\n```python\n(.*?)```", readme, re.S).group(1)
    script = tmp_path / "example.py"
    script.write_text(code)
    out = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=600,
                         env=dict(os.environ))
    assert out.returncode == 0, out.stderr[-3000:]
    assert "trained; rollouts came from PagedJaxRollout" in out.stdout
