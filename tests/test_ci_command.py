"""CI runs exactly the README's test command (``.ci/run``'s last line), so the `--no-deps`
installs it carries (nvidia-cudnn-frontend, tf-keras) cannot drift apart."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## Test (what `.ci/run` runs)", 1)
    assert len(section) == 2, "README.md lost its '## Test (what `.ci/run` runs)' section"
    block = re.search(r"```bash\n(.*?)\n```", section[1], re.S)
    assert block, "the README's test section has no bash block"
    ci = (ROOT / ".ci" / "run").read_text().strip().splitlines()[-1]
    assert block.group(1).strip() == ci
