"""README.md is a front page, and the docs it points into hold together.

The front page stays short (under 12 KB) and shows the two commands; every
relative link in README.md and docs/*.md names a file that exists and, for an
``#anchor`` into a markdown file, a heading that exists (GitHub's slugs); the
training script README shows compiles, imports only what ``checkpoints``
exports, and passes only keyword arguments the real constructors take.
"""

from __future__ import annotations

import ast
import inspect
import re
from pathlib import Path
from urllib.parse import unquote

import pytest

ROOT = Path(__file__).resolve().parents[3]
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
MAX_BYTES = 12 * 1024

FENCE = re.compile(r"^(```|~~~).*?^\1[ \t]*$", re.S | re.M)
LINK = re.compile(r"!?\[(?:[^\]\[]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
HEADING = re.compile(r"^(#{1,6})[ \t]+(.+?)[ \t]*#*[ \t]*$", re.M)
EXTERNAL = re.compile(r"^[a-z][a-z0-9+.-]*:", re.I)  # http:, https:, mailto:, ...


def prose(text: str) -> str:
    """``text`` without its fenced code blocks (a ``# comment`` there is no heading)."""
    return FENCE.sub("", text)


def slug(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation dropped, spaces to ``-``."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link's text only
    text = text.replace("`", "").strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every heading anchor of ``path``; repeated headings get ``-1``, ``-2``... as on GitHub."""
    seen: dict[str, int] = {}
    out = set()
    for match in HEADING.finditer(prose(path.read_text())):
        base = slug(match.group(2))
        count = seen.get(base, 0)
        seen[base] = count + 1
        out.add(base if count == 0 else f"{base}-{count}")
    return out


def relative_links(path: Path) -> list[str]:
    return [t for t in LINK.findall(prose(path.read_text())) if not EXTERNAL.match(t)]


def broken_links(path: Path) -> list[str]:
    broken = []
    for target in relative_links(path):
        file_part, _, anchor = target.partition("#")
        dest = (path.parent / unquote(file_part)).resolve() if file_part else path
        if not dest.exists():
            broken.append(f"{target}: {dest} does not exist")
        elif anchor and dest.suffix == ".md" and unquote(anchor) not in anchors(dest):
            broken.append(f"{target}: {dest.name} has no heading with anchor #{anchor}")
    return broken


def readme_python_blocks() -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", README.read_text(), re.S | re.M)


def test_the_readme_is_a_front_page_under_12_kb() -> None:
    size = len(README.read_bytes())
    assert size < MAX_BYTES, f"README.md is {size} bytes; a front page stays under {MAX_BYTES}"


def test_the_readme_shows_the_two_commands() -> None:
    text = README.read_text()
    for command in ("make demo", "make test"):
        assert re.search(rf"^{command}\b", text, re.M), f"README.md does not show `{command}`"


@pytest.mark.parametrize("path", [README, *DOCS], ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_points_at_an_existing_file_and_heading(path: Path) -> None:
    broken = broken_links(path)
    assert not broken, f"{path.relative_to(ROOT)} has broken links:\n" + "\n".join(broken)


def test_the_readme_links_into_the_docs() -> None:
    linked = {(README.parent / t.partition("#")[0]).resolve() for t in relative_links(README)}
    assert {p.resolve() for p in DOCS} <= linked, (
        "README.md's 'Where to read on' should link every docs page; missing: "
        + ", ".join(sorted(p.name for p in DOCS if p.resolve() not in linked))
    )


def test_the_link_checker_finds_broken_links_and_anchors(tmp_path: Path) -> None:
    (tmp_path / "a.md").write_text(
        "# Title\n\n## One machine: `tidal up`\n\n```bash\n# not a heading\n```\n"
        "[ok](b.md#the-b-page) [ok](#one-machine-tidal-up) [web](https://example.com/x)\n"
        "[gone](missing.md) [bad anchor](b.md#nope) [code block](#not-a-heading)\n"
    )
    (tmp_path / "b.md").write_text("# The B page\n")
    found = broken_links(tmp_path / "a.md")
    assert [f.split(":")[0] for f in found] == ["missing.md", "b.md#nope", "#not-a-heading"], found


def test_the_readme_training_script_compiles() -> None:
    blocks = readme_python_blocks()
    assert blocks, "README.md shows no ```python block (the training script)"
    for n, code in enumerate(blocks):
        compile(code, f"README.md python block {n}", "exec")


def test_the_readme_training_script_uses_the_real_checkpoints_api() -> None:
    import checkpoints

    code = "\n".join(readme_python_blocks())
    tree = ast.parse(code)
    imported = {
        alias.asname or alias.name: alias.name
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and node.module == "checkpoints"
        for alias in node.names
    }
    assert {"Checkpointer", "ElasticBatchSampler"} <= set(imported.values()), imported
    assert set(imported.values()) <= set(checkpoints.__all__), imported
    for node in ast.walk(tree):
        called = isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
        if called and node.func.id in imported:
            target = getattr(checkpoints, imported[node.func.id])
            params = inspect.signature(target).parameters
            for keyword in node.keywords:
                assert keyword.arg in params, f"{target.__name__} takes no argument {keyword.arg!r}"
    methods = {"restore", "maybe_save", "save", "close"}
    assert methods <= {n.func.attr for n in ast.walk(tree)
                       if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)}
    assert all(callable(getattr(checkpoints.Checkpointer, m)) for m in methods)
    sampler = checkpoints.ElasticBatchSampler(dataset_len=10, global_batch_size=4, rank=0,
                                              world_size=2)
    assert sampler.plan.loss_scale == 2 / 4  # W / B: the sum of per-sample losses times this
