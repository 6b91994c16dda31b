"""A griffe extension for the API pages: the docstrings are reStructuredText prose (Sphinx roles, ``::``
literal blocks, doctest examples) read by a Markdown renderer, so each docstring is rewritten once,
when griffe loads it:

- ``:class:`~a.b.C``` and the other roles become a link to the documented object (an *optional*
  cross-reference: plain code where the object has no page), its text the last component with ``~``;
  a relative target (``.rates``, ``Context``) is resolved against the object's own module;
- a paragraph ending in ``::`` keeps one ``:`` and its indented block becomes a fenced code block;
- a run of ``>>>`` lines with their output becomes a fenced ``pycon`` block.

The Google-style sections (``Args:``, ``Returns:``, ``Raises:``) are parsed by griffe afterwards.
"""

from __future__ import annotations

import html
import re
import textwrap

import griffe

ROLE = re.compile(r":(?:py:)?(class|func|meth|mod|attr|data|exc|obj):`([^`]+)`")


def _target(text: str, module: str, package: str) -> tuple[str, str]:
    """(identifier, shown text) of a role's content: ``title <target>``, ``~a.b.c`` or ``a.b.c``."""
    m = re.fullmatch(r"(.*?)\s*<([^>]+)>", text, flags=re.S)
    if m:
        title, target = m.group(1).strip(), m.group(2).strip()
    else:
        target = text.strip()
        title = target.lstrip("~").rsplit(".", 1)[-1] if target.startswith("~") else target.lstrip(".")
    title, target = " ".join(title.split()), "".join(target.lstrip("~").split())
    if target.startswith("."):                        # relative to the object's package
        target = f"{package}.{target.lstrip('.')}"
    elif "." not in target:                           # a name of the object's own module
        target = f"{module}.{target}"
    return target, title


def _roles(text: str, module: str, package: str) -> str:
    def link(m: re.Match) -> str:
        target, title = _target(m.group(2), module, package)
        return f'<autoref identifier="{html.escape(target)}" optional><code>{html.escape(title)}</code></autoref>'
    return ROLE.sub(link, text)


def _blocks(doc: str) -> str:
    """``::`` literal blocks and doctest runs as fenced code blocks."""
    lines, out, i = doc.splitlines(), [], 0
    while i < len(lines):
        line = lines[i]
        if line.lstrip().startswith(">>> "):
            indent = line[: len(line) - len(line.lstrip())]
            block = []
            while i < len(lines) and lines[i].strip():
                block.append(lines[i])
                i += 1
            out += [f"{indent}```pycon", *block, f"{indent}```"]
            continue
        if line.rstrip().endswith("::"):
            out.append(line.rstrip()[:-1] if line.strip() != "::" else "")
            indent = len(line) - len(line.lstrip())
            j, block = i + 1, []
            while j < len(lines) and (not lines[j].strip() or len(lines[j]) - len(lines[j].lstrip()) > indent):
                block.append(lines[j])
                j += 1
            while block and not block[-1].strip():
                block.pop()
            if block:
                pad = " " * indent
                body = textwrap.dedent("\n".join(block)).strip("\n").splitlines()
                out += ["", f"{pad}```python", *(pad + b if b else "" for b in body), f"{pad}```", ""]
                i = j
                continue
            i += 1
            continue
        out.append(line)
        i += 1
    return "\n".join(out)


def _module_of(obj: griffe.Object) -> tuple[str, str]:
    """The object's module and the package its relative names start from."""
    mod = obj if obj.is_module else obj.module
    package = mod.path if mod.is_init_module else mod.path.rpartition(".")[0] or mod.path
    return mod.path, package


class RstDocstrings(griffe.Extension):
    """Rewrite every docstring's reStructuredText constructs into the Markdown mkdocstrings renders."""

    def on_instance(self, *, obj: griffe.Object, **kwargs) -> None:
        if obj.docstring is not None:
            obj.docstring.value = _roles(_blocks(obj.docstring.value), *_module_of(obj))
