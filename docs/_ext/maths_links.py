"""Turn the docstrings' references to the maths page ("docs/maths.md §3.2", "§A.5–§A.8") into
links to its sections on the site.

Every numbered heading of docs/maths.md ("## 3. …", "### 3.2 …", "## Appendix A. …") gets the
label ``maths-<number>``; a reference to a number without a heading of its own (a numbered
paragraph such as §12.14) links to the closest enclosing section (§12). A reference to a section
that does not exist fails the build (``-W``)."""

from __future__ import annotations

import re
from pathlib import Path

from docutils import nodes

HEADING = re.compile(r"^(?:Appendix )?([0-9A-Z]+(?:\.[0-9]+)*)\.?\s")
REFERENCE = re.compile(r"docs/maths\.md ((?:§[0-9A-Z]+(?:\.[0-9]+)*)(?:(?:, | and |–|-)§[0-9A-Z]+(?:\.[0-9]+)*)*)")
SECTION = re.compile(r"§([0-9A-Z]+(?:\.[0-9]+)*)")


def _numbers(maths: Path) -> set:
    out = set()
    for line in maths.read_text(encoding="utf-8").splitlines():
        if line.startswith("## ") or line.startswith("### "):
            m = HEADING.match(line.lstrip("#").strip())
            if m:
                out.add(m.group(1))
    return out


def _target(number: str, known: set) -> str:
    parts = number.split(".")
    while parts and ".".join(parts) not in known:
        parts.pop()
    return ".".join(parts) if parts else number  # unknown: left to fail as an unresolved label


def _link_references(app, what, name, obj, options, lines):
    known = app.env.maths_numbers

    def link(match):
        refs = SECTION.sub(lambda s: f":ref:`§{s.group(1)} <maths-{_target(s.group(1), known)}>`",
                           match.group(1))
        return f"maths {refs}"

    for i, line in enumerate(lines):
        if "docs/maths.md §" in line:
            lines[i] = REFERENCE.sub(link, line)


def _register_labels(app, doctree):
    if app.env.docname != "maths":
        return
    std = app.env.domains.standard_domain if hasattr(app.env, "domains") else app.env.get_domain("std")
    for section in doctree.findall(nodes.section):
        m = HEADING.match(section[0].astext())
        if m and section["ids"]:
            label = f"maths-{m.group(1)}".lower()  # :ref: targets are lower case
            std.anonlabels[label] = ("maths", section["ids"][0])
            std.labels[label] = ("maths", section["ids"][0], f"§{m.group(1)}")


def _read_numbers(app):
    app.env.maths_numbers = _numbers(Path(app.srcdir) / "maths.md")


def setup(app):
    app.connect("builder-inited", _read_numbers)
    app.connect("autodoc-process-docstring", _link_references)
    app.connect("doctree-read", _register_labels)
    return {"parallel_read_safe": False, "parallel_write_safe": True}
