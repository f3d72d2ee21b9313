"""Serve MathJax from the built site and refuse any page that loads something from the network.

Sphinx's mathjax extension points at a CDN by default; a reader offline (or behind a firewall) would
see raw TeX. This extension copies MathJax 3 (vendored by the ``sphinx-mathjax-offline``
distribution, a pure data package) into ``_static/mathjax`` and points ``mathjax_path`` at it. When
the build has finished it scans every HTML page and stylesheet of the output for a resource loaded
from an ``http(s)://`` or protocol-relative URL (scripts, stylesheets, images, fonts, CSS
``url(...)``/``@import``) and fails the build if it finds one. Links a reader clicks (``<a href>``)
are not loads and are allowed.
"""

from __future__ import annotations

import re
from importlib.metadata import PackageNotFoundError, distribution
from pathlib import Path

from sphinx.application import Sphinx
from sphinx.errors import ExtensionError
from sphinx.util.fileutil import copy_asset

MATHJAX_ENTRY = "mathjax/tex-chtml.js"

# attributes that make a browser fetch something, on the elements that use them
_LOADING_ATTRIBUTE = re.compile(
    r"<(script|img|iframe|source|audio|video|embed)\b[^>]*?\bsrc\s*=\s*[\"']?\s*(?P<url>(?:https?:)?//[^\"'\s>]+)"
    r"|<link\b[^>]*?\bhref\s*=\s*[\"']?\s*(?P<link>(?:https?:)?//[^\"'\s>]+)[^>]*>",
    re.IGNORECASE,
)
_CSS_URL = re.compile(r"(?:url\(\s*[\"']?|@import\s+[\"'])\s*(?P<url>(?:https?:)?//[^\"')\s]+)", re.IGNORECASE)
# <link> elements that only name a page (canonical, alternate, ...) are not fetched by a browser
_NON_FETCHING_REL = re.compile(
    r"\brel\s*=\s*[\"']?(canonical|alternate|author|license|help|search|next|prev|index)\b", re.IGNORECASE)


def _vendored_mathjax() -> Path:
    try:
        dist = distribution("sphinx-mathjax-offline")
    except PackageNotFoundError as exc:  # pragma: no cover - the docs extra installs it
        raise ExtensionError(
            "offline_mathjax: the 'sphinx-mathjax-offline' package (MathJax 3 files) is not installed; "
            "install the docs extra: pip install -e '.[docs]'") from exc
    folder = Path(dist.locate_file("sphinx-mathjax-offline/static/mathjax"))
    if not (folder / "tex-chtml.js").is_file():
        raise ExtensionError(f"offline_mathjax: no tex-chtml.js under {folder}; reinstall sphinx-mathjax-offline")
    return folder


def _configure(app: Sphinx, config) -> None:
    config.mathjax_path = MATHJAX_ENTRY


def _copy_and_check(app: Sphinx, exc: Exception | None) -> None:
    if exc is not None or app.builder.format != "html":
        return
    out = Path(app.outdir)
    copy_asset(str(_vendored_mathjax()), str(out / "_static" / "mathjax"))
    offenders = []
    # the pages of this build (a stale page left in the output folder by an earlier build is no
    # page of the site): the documents, the generated index and search pages, viewcode's sources
    pages = {Path(app.builder.get_outfilename(doc)) for doc in app.env.found_docs}
    pages |= {out / "genindex.html", out / "search.html", out / "py-modindex.html"}
    pages |= set((out / "_modules").rglob("*.html"))
    for page in sorted(p for p in pages if p.is_file()):
        for match in _LOADING_ATTRIBUTE.finditer(page.read_text(encoding="utf-8", errors="replace")):
            url = match.group("url") or match.group("link")
            if match.group("link") and _NON_FETCHING_REL.search(match.group(0)):
                continue
            offenders.append(f"{page.relative_to(out)}: {url}")
    for sheet in sorted((out / "_static").rglob("*.css")):
        for match in _CSS_URL.finditer(sheet.read_text(encoding="utf-8", errors="replace")):
            offenders.append(f"{sheet.relative_to(out)}: {match.group('url')}")
    if offenders:
        listing = "\n  ".join(offenders[:20])
        raise ExtensionError(
            f"offline_mathjax: {len(offenders)} resource(s) would be loaded from the network, the site must "
            f"work offline:\n  {listing}")


def setup(app: Sphinx) -> dict:
    app.connect("config-inited", _configure)
    app.connect("build-finished", _copy_and_check)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
