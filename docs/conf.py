"""Sphinx configuration of the quotient-manifolds documentation.

Build (warnings are errors; the tutorials run during the build and a failing one fails it):

    python -m sphinx -W --keep-going -b html docs docs/_build/html
"""

import os
import sys
from importlib.util import find_spec
from pathlib import Path

DOCS = Path(__file__).resolve().parent
ROOT = DOCS.parent
sys.path.insert(0, str(ROOT))            # document the working tree, not an installed copy
sys.path.insert(0, str(DOCS / "_ext"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")           # the tutorials build models from configs
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("MPLBACKEND", "Agg")

import quotient_manifolds  # noqa: E402

project = "quotient-manifolds"
author = "quotient-manifolds contributors"
copyright = "the quotient-manifolds contributors"
release = quotient_manifolds.__version__
version = release

extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "sphinx.ext.mathjax",
    "sphinx.ext.viewcode",
    "myst_parser",
    "sphinx_gallery.gen_gallery",
    "sphinx_copybutton",
    "offline_mathjax",                   # docs/_ext: MathJax served from the build, no CDN
    "maths_links",                       # docs/_ext: "docs/maths.md §3.2" in docstrings -> a link
]

source_suffix = {".rst": "restructuredtext", ".md": "markdown"}
root_doc = "index"
exclude_patterns = ["_build", "tutorials/README.txt", "Thumbs.db", ".DS_Store"]
templates_path = []

# --- MyST: $...$ and $$...$$ maths, definition lists for the glossary -------------------------------
myst_enable_extensions = ["dollarmath", "amsmath", "deflist", "colon_fence"]
myst_heading_anchors = 3

# --- autodoc ----------------------------------------------------------------------------------------
autodoc_default_options = {"members": True, "member-order": "bysource", "show-inheritance": True}
autodoc_typehints = "signature"
autodoc_preserve_defaults = True

# A signature written from a dataclass (quotient_manifolds.adapters.options.document_options:
# ``sharpness(model, batches, *, rho, **options)`` lists every option with its default) has
# defaults the function's source does not: preserve_defaults, which reads them from the source,
# would fail on it. Such a signature's defaults are the real values already. (Sphinx 9 calls
# update_default_value from autodoc's signature module, earlier versions update_defvalue.)
import importlib  # noqa: E402


def _skip_written_signatures(module_name: str, function_name: str) -> None:
    try:
        module = importlib.import_module(module_name)
    except ImportError:
        return
    original = getattr(module, function_name, None)
    if original is None:
        return

    def from_source(obj, *args, **kwargs):
        target = args[0] if len(args) == 2 else obj   # update_defvalue(app, obj, bound_method)
        if getattr(target, "__signature__", None) is None:
            original(obj, *args, **kwargs)

    setattr(module, function_name, from_source)


_skip_written_signatures("sphinx.ext.autodoc._dynamic._signatures", "update_default_value")
_skip_written_signatures("sphinx.ext.autodoc.preserve_defaults", "update_defvalue")
autoclass_content = "both"
# curvlinops-for-pytorch (the Riemannian Hessian) is installed with --no-deps, outside any extra (its
# requirements pull torchvision and another torch), so the `docs` extra cannot bring it: where it is
# missing, autodoc imports adapters.hessian against a stand-in and the API pages are the same.
# Likewise lightning (the `lightning` extra), for adapters.lightning's callback.
autodoc_mock_imports = [name for name in ("curvlinops", "lightning") if find_spec(name) is None]
autodoc_type_aliases = {"PyTorchLinearOperator": "PyTorchLinearOperator"}   # same text either way
napoleon_google_docstring = True
napoleon_numpy_docstring = True
napoleon_custom_sections = ["Use"]          # a heading, not a section of the page
napoleon_use_param = False             # "n, m, h" stays one entry with one description
add_module_names = False
python_maximum_signature_line_length = 100   # a longer signature: one parameter a line

# --- the executed tutorials (sphinx-gallery) ------------------------------------------------------
sphinx_gallery_conf = {
    "examples_dirs": "tutorials",
    "gallery_dirs": "auto_tutorials",
    "filename_pattern": r"/tutorial_",   # every tutorial_*.py is executed at build time
    "ignore_pattern": r"__init__\.py",
    "download_all_examples": False,
    "remove_config_comments": True,
    "matplotlib_animations": False,
    "image_scrapers": ("matplotlib",),
    "abort_on_example_error": False,     # run them all, then fail the build if any failed
    "only_warn_on_example_error": False,
    "show_memory": False,
    "write_computation_times": False,   # its timing pages load scripts from CDNs
    "line_numbers": False,
    "default_thumb_file": None,
    "within_subsection_order": "FileNameSortKey",
}

# --- HTML -------------------------------------------------------------------------------------------
html_theme = "furo"
html_title = f"quotient-manifolds {release}"
html_static_path = ["_static"]
html_css_files = ["custom.css"]
html_show_sourcelink = False
html_theme_options = {"navigation_with_keys": True}


# --- docstrings: numpy-style fields written "name: description" ------------------------------------
# The library's docstrings put a parameter's description on its name's line ("rho: radius of the
# ball ..."). numpydoc reads the text after the colon as the parameter's *type*, which would render
# a sentence in italics as a type. Move it to the description before napoleon parses the section.
import dataclasses  # noqa: E402
import re  # noqa: E402

_NUMPY_SECTIONS = {"parameters", "other parameters", "returns", "yields", "raises", "attributes"}
_FIELD = re.compile(r"^(?P<name>[A-Za-z_*][\w*]*(?:\s*,\s*[A-Za-z_*][\w*]*)*)\s*:(?:\s+(?P<text>\S.*))?$")


def _fields_on_their_own_line(app, what, name, obj, options, lines):
    section_indent = None
    i = 0
    while i < len(lines):
        line = lines[i]
        stripped = line.strip()
        nxt = lines[i + 1].strip() if i + 1 < len(lines) else ""
        if stripped.lower() in _NUMPY_SECTIONS and nxt and set(nxt) == {"-"}:
            section_indent = len(line) - len(line.lstrip())
            i += 2
            continue
        if section_indent is not None:
            indent = len(line) - len(line.lstrip())
            if stripped and indent < section_indent:
                section_indent = None
            elif stripped and indent == section_indent:
                match = _FIELD.match(stripped)
                if match and match["text"]:
                    lines[i:i + 1] = [" " * indent + match["name"], " " * (indent + 4) + match["text"]]
                    i += 1
                elif not match and i > 0 and not lines[i - 1].strip():
                    # a paragraph after the fields: numpydoc would read it as more fields
                    lines[i:i] = [" " * indent + "Notes", " " * indent + "-----"]
                    section_indent = None
                    i += 2
        i += 1


# Absolute values and norms written |w| or ‖·‖ are reST substitution references ("|w|"); escape the
# bars outside inline literals so that they print as written.
_BARS = re.compile(r"(?<![\\|])\|(?=\S)([^|`\n]{1,60}?)(?<=\S)\|(?![_|])")


def _escape_bars(app, what, name, obj, options, lines):
    for i, line in enumerate(lines):
        row = line.strip()
        if "|" not in line or row.startswith("+-") or (row.startswith("|") and row.endswith("|")):
            continue                     # no bar, or a table row
        parts = line.split("``")
        parts[::2] = [_BARS.sub(lambda m: "\\|" + m.group(1) + "\\|", part) for part in parts[::2]]
        lines[i] = "``".join(parts)


def _no_docstring_of_the_type(app, what, name, obj, options, lines):
    """A constant (a tuple, a group object) has its type's docstring ("Built-in immutable
    sequence..."); its API entry says what it is instead (the directive's content)."""
    if what in ("data", "attribute") and getattr(obj, "__doc__", None) == getattr(type(obj), "__doc__", None):
        lines.clear()


# Dataclasses (Layout, SharpnessResult, ...): the signature autodoc takes from the generated __init__
# mixes "~typing.List[~quotient_manifolds.adapters.blocks.GLBlock]" with quoted annotations and shows
# "<factory>" for a default made by a factory. Write it from the fields instead: short type names,
# and a factory's default as the value it makes ([], {}).
_QUALIFIED = re.compile(r"~?\b(?:[A-Za-z_]\w*\.)+(?=[A-Za-z_])")


def _type_text(annotation) -> str:
    if isinstance(annotation, str):
        text = annotation
    elif isinstance(annotation, type):
        text = annotation.__qualname__
    else:
        text = repr(annotation)
    return _QUALIFIED.sub("", text).replace("NoneType", "None")


def _dataclass_signature(app, what, name, obj, options, signature, return_annotation):
    if what not in ("class", "exception") or not dataclasses.is_dataclass(obj) or signature is None:
        return None
    params = []
    for field in dataclasses.fields(obj):
        if not field.init:
            continue
        text = f"{field.name}: {_type_text(field.type)}"
        if field.default is not dataclasses.MISSING:
            text += f" = {field.default!r}"
        elif field.default_factory is not dataclasses.MISSING:
            text += f" = {field.default_factory()!r}"
        params.append(text)
    return f"({', '.join(params)})", return_annotation


def setup(app):
    app.connect("autodoc-process-signature", _dataclass_signature)
    app.connect("autodoc-process-docstring", _no_docstring_of_the_type, priority=50)
    app.connect("autodoc-process-docstring", _fields_on_their_own_line, priority=100)
    app.connect("autodoc-process-docstring", _escape_bars, priority=101)
