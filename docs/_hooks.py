"""mkdocs hooks for the trio-rollout docs (``mkdocs.yml``: ``hooks``).

- ``<!-- api: PACKAGE -->`` (or ``<!-- api: PACKAGE skip=OTHER -->``) on a reference page expands to one mkdocstrings ``:::`` block per
  name in ``PACKAGE.__all__``, each pointing at the module that defines it: the package's
  ``_LAZY`` map (``engine``, ``workflows``, ``rewards``, ``engine.openai``, ...) or, for a
  package that imports its names, the package itself (griffe follows the import).  Read
  statically with :mod:`ast`, like griffe: building the docs imports nothing of the project
  (no torch), and a name added to ``__all__`` or moved to another module is documented
  without editing the page.
- The docstrings are written with reST's Sphinx roles and literal-block markers
  (``:class:`X```, ``text::``); on the rendered reference pages the role prefix is dropped (the
  name stays code) and ``::`` reads as ``:``.
- The benchmark plots in ``benchmarks/reference/*.png`` are served under the same path, so
  the performance page shows them without a copy in ``docs/``.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

from mkdocs.structure.files import File

ROOT = Path(__file__).resolve().parent.parent
_MARKER = re.compile(r"^<!-- api: ([\w.]+)(?: skip=([\w.]+))? -->$", re.MULTILINE)
_PLOTS = "benchmarks/reference"


def public_names(package: str) -> list[tuple[str, str]]:
    """``(name, defining module)`` for each name of ``package.__all__`` (a package or a module), in
    ``__all__``'s order."""
    init = ROOT.joinpath(*package.split("."), "__init__.py")
    if not init.exists():  # a module, not a package
        init = ROOT.joinpath(*package.split(".")).with_suffix(".py")
    tree = ast.parse(init.read_text(encoding="utf-8"))
    names: list[str] = []
    lazy: dict[str, str] = {}
    for node in tree.body:
        if not isinstance(node, ast.Assign) or len(node.targets) != 1 or not isinstance(node.targets[0], ast.Name):
            continue
        if node.targets[0].id == "__all__":
            names = list(ast.literal_eval(node.value))
        elif node.targets[0].id == "_LAZY":
            # a literal dict, or one built from literal comprehensions (engine.serve): the project's
            # own source, evaluated with no builtins
            lazy = dict(eval(compile(ast.Expression(node.value), str(init), "eval"), {"__builtins__": {}}))
    if not names:
        raise ValueError(f"{init}: no __all__ list to document")
    return [(name, lazy.get(name, package)) for name in names]


def api_markdown(package: str, skip: str | None = None) -> str:
    """The ``:::`` blocks for ``package``'s public names.  With ``skip`` (another package, whose
    reference page is ``reference/SKIP.md``), the names ``skip`` exports too are not documented
    again (one heading per object: autorefs refuses two) but linked to their entries there."""
    shown = public_names(package)
    linked: list[str] = []
    if skip:
        elsewhere = dict(public_names(skip))
        linked = [f"[`{name}`]({skip}.md#{elsewhere[name]}.{name})" for name, _ in shown if name in elsewhere]
        shown = [(name, module) for name, module in shown if name not in elsewhere]
    blocks = [f"::: {module}.{name}" for name, module in shown]
    if linked:
        blocks.insert(0, f"Also exported by `{skip}` and documented there: " + ", ".join(linked) + ".")
    return "\n\n".join(blocks)


def on_page_markdown(markdown: str, page, config, files) -> str:
    def expand(match: re.Match[str]) -> str:
        return api_markdown(match.group(1), match.group(2))

    return _MARKER.sub(expand, markdown)


_ROLE = re.compile(r":(?:py:)?(?:class|func|meth|mod|data|attr|exc|obj|const):(?=<code)")


def on_page_content(html: str, page, config, files) -> str:
    if not page.file.src_uri.startswith("reference/"):
        return html
    html = _ROLE.sub("", html)
    return html.replace("<p>::</p>", "").replace("::</p>", ":</p>")


def on_files(files, config):
    for png in sorted((ROOT / _PLOTS).glob("*.png")):
        files.append(File(f"{_PLOTS}/{png.name}", str(ROOT), config["site_dir"], config["use_directory_urls"]))
    return files
