"""The README stays a first screen: small, its commands are ones the project has, and every page it
and the docs link to exists."""

from __future__ import annotations

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def test_the_readme_is_a_first_screen():
    assert len(README.encode()) <= 8 * 1024, "move figures and long sections to docs/ pages the README links"


def test_every_command_in_the_readmes_code_blocks_is_one_the_project_has():
    targets = set(re.findall(r"^([\w-]+):", (ROOT / "Makefile").read_text(), re.M))
    commands = [line.split("#")[0].strip() for block in re.findall(r"```bash\n(.*?)```", README, re.S)
                for line in block.splitlines()]
    commands += re.findall(r"`(\.venv/bin/python [^`]+)`", README)
    assert commands
    for command in filter(None, commands):
        words = command.split()
        if words[0] == "make":
            assert words[1] in targets, command
        elif words[:2] == [".venv/bin/python", "-m"]:
            module = words[2]
            assert module == "pytest" or (ROOT / (module.replace(".", "/") + ".py")).exists(), command
        elif words[0] == ".venv/bin/python":
            assert (ROOT / words[1]).exists(), command
        else:
            raise AssertionError(f"unknown kind of README command: {command!r}")


def test_every_link_in_the_readme_and_the_docs_names_a_file_the_repository_has():
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    for page in pages:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text()):
            if "://" in target:
                continue
            assert (page.parent / target).exists(), f"{page.relative_to(ROOT)} links {target}"


REPOSITORY_PATH = re.compile(r"\b((?:actors|jobs|trainer|vgbs_ray|tests|benchmarks|examples|docs)/[A-Za-z0-9_./-]+"
                             r"\.(?:py|md|yaml|json|sh))")


def test_every_repository_path_the_docs_and_docstrings_name_exists():
    """A path like `actors/weight_sync.py` in a page, a module or a test names a file the repository has."""
    sources = [ROOT / "README.md", *(ROOT / "docs").glob("*.md"),
               *(path for folder in ("actors", "jobs", "trainer", "vgbs_ray", "tests", "benchmarks", "examples")
                 for path in (ROOT / folder).rglob("*.py"))]
    missing = {(str(source.relative_to(ROOT)), path) for source in sources
               for path in REPOSITORY_PATH.findall(source.read_text()) if not (ROOT / path).exists()}
    assert not missing, sorted(missing)
