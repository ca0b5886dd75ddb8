"""Every test file that the docs, the package's comments, tools/ and CI name exists (tests/README.md's layout): a
moved or renamed test module leaves no stale `tests/...py` reference behind. bench/results/ (logs of past runs) and
experiments/ (one-off scripts that cite files in git history) are records, not checked."""

import re
import subprocess

from helpers import REPO

CHECKED = ("README.md", "pyproject.toml", ".ci/", "docs/", "fastremover/", "tools/", "tests/")
TEST_PATH = re.compile(r"tests/[A-Za-z0-9_/*]+\.py")


def _tracked_text_files():
    listed = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, text=True, check=True)
    for name in listed.stdout.split("\0"):
        path = REPO / name
        if name.startswith(CHECKED) and path.is_file():
            try:
                yield name, path.read_text()
            except UnicodeDecodeError:
                continue


def test_named_test_files_exist():
    missing = []
    for name, text in _tracked_text_files():
        for match in TEST_PATH.finditer(text):
            ref = match.group(0)
            found = any(REPO.glob(ref)) if "*" in ref else (REPO / ref).is_file()
            if not found:
                missing.append(f"{name}: {ref}")
    assert not missing, "references to test files that do not exist:\n" + "\n".join(missing)


def test_the_pattern_sees_the_layout():
    # the check above is not vacuous: the docs do name test files in their folders, and a flat path would be caught
    names = [m.group(0) for _, text in _tracked_text_files() for m in TEST_PATH.finditer(text)]
    assert "tests/unit/test_config.py" in names and "tests/kernels/test_kernels.py" in names
    assert not (REPO / "tests" / "test_config.py").exists()
