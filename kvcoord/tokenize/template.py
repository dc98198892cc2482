"""What vLLM 0.33 reads off a chat template's source before rendering it (``vllm/renderers/hf.py``):
whether message content reaches it as a string or as OpenAI parts, whether it knows the ``developer``
role, and which variables it reads (the kwargs filter). Re-implemented over jinja2's AST from that
behaviour; needs jinja2, which ``transformers[chat-template]`` brings.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from functools import lru_cache
from typing import Any, Literal

import jinja2
import jinja2.ext
import jinja2.meta
import jinja2.nodes
import jinja2.sandbox

__all__ = ["detect_content_format", "supports_developer_role", "template_variables"]


class _Generation(jinja2.ext.Extension):
    """``{% generation %}…{% endgeneration %}`` (transformers' assistant-mask tag): parsed, body kept."""

    tags = {"generation"}  # noqa: RUF012 (jinja2's own class attribute)

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Any) -> Any:
        return caller()


def _environment() -> jinja2.sandbox.ImmutableSandboxedEnvironment:
    """The parse-relevant settings of transformers' chat-template environment."""
    return jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_Generation, jinja2.ext.loopcontrols])


@lru_cache(maxsize=64)
def template_variables(template: str) -> frozenset[str]:
    """The undeclared variables of ``template``: vLLM passes only those (and apply_chat_template's own
    parameters) of the request's ``chat_template_kwargs`` on to the renderer.
    """
    return frozenset(jinja2.meta.find_undeclared_variables(_environment().parse(template)))


@lru_cache(maxsize=64)
def supports_developer_role(template: str) -> bool:
    """vLLM's test: the template spells the role as a string literal somewhere."""
    return '"developer"' in template or "'developer'" in template


class _TupleTarget(Exception):
    """A matched loop unpacks into several names: vLLM's detection gives up there (format "string")."""


def _loads(node: jinja2.nodes.Node, name: str) -> bool:
    """``node`` reads the variable ``name``; a dotted ``ns.attr`` name matches attribute access."""
    if isinstance(node, jinja2.nodes.Name):
        return node.ctx == "load" and node.name == name
    if isinstance(node, jinja2.nodes.Getattr) and "." in name:
        base, _, attr = name.rpartition(".")
        return node.attr == attr and _loads(node.node, base)
    return False


def _reads(node: jinja2.nodes.Node, name: str, key: str | None = None) -> bool:
    """``node`` is ``name`` (or ``name.key`` / ``name['key']``), possibly filtered, tested or sliced."""
    if isinstance(node, jinja2.nodes.Filter):
        return node.node is not None and _reads(node.node, name, key)
    if isinstance(node, jinja2.nodes.Test):
        return _reads(node.node, name, key)
    if isinstance(node, jinja2.nodes.Getitem) and isinstance(node.arg, jinja2.nodes.Slice):
        return _reads(node.node, name, key)
    if key is None:
        return _loads(node, name)
    if isinstance(node, jinja2.nodes.Getitem):
        return _loads(node.node, name) and isinstance(node.arg, jinja2.nodes.Const) and node.arg.value == key
    if isinstance(node, jinja2.nodes.Getattr):
        return _loads(node.node, name) and node.attr == key
    return False


def _dotted(node: jinja2.nodes.Node) -> str | None:
    if isinstance(node, jinja2.nodes.NSRef):
        return f"{node.name}.{node.attr}"
    attrs: list[str] = []
    while isinstance(node, jinja2.nodes.Getattr):
        attrs.append(node.attr)
        node = node.node
    if isinstance(node, jinja2.nodes.Name):
        return ".".join([node.name, *reversed(attrs)])
    return None


def _aliases(root: jinja2.nodes.Template, name: str) -> list[str]:
    """``name`` and every variable assigned from it, transitively (``set``, ``namespace(x=…)``, ``ns.x``)."""
    found = [name]
    seen = {name}
    queue = deque([name])
    while queue:
        current = queue.popleft()
        for assign in root.find_all(jinja2.nodes.Assign):
            lhs, rhs = assign.target, assign.node
            new: list[str] = []
            if isinstance(lhs, jinja2.nodes.Name) and _reads(rhs, current):
                new = [lhs.name]
            elif (isinstance(lhs, jinja2.nodes.Name) and isinstance(rhs, jinja2.nodes.Call)
                  and isinstance(rhs.node, jinja2.nodes.Name) and rhs.node.name == "namespace"):
                new = [f"{lhs.name}.{kw.key}" for kw in rhs.kwargs if _reads(kw.value, current)]
            elif isinstance(lhs, (jinja2.nodes.Getattr, jinja2.nodes.NSRef)) and _reads(rhs, current):
                dotted = _dotted(lhs)
                new = [dotted] if dotted is not None else []
            for alias in new:
                found.append(alias)
                if alias not in seen:
                    seen.add(alias)
                    queue.append(alias)
    return found


def _target(loop: jinja2.nodes.For) -> str:
    if not isinstance(loop.target, jinja2.nodes.Name):
        raise _TupleTarget
    return loop.target.name


def _message_names(root: jinja2.nodes.Template) -> list[str]:
    """Loop variables bound by ``{% for m in messages %}`` (or any alias of ``messages``)."""
    names = _aliases(root, "messages")
    out = []
    for loop in root.find_all(jinja2.nodes.For):
        if any(_reads(loop.iter, n) for n in names):
            out.append(_target(loop))
    return out


def _macro_content_params(
    root: jinja2.nodes.Template, messages: list[str]
) -> tuple[dict[int, set[str]], set[int]]:
    """Per loop inside a macro: the macro parameters that some call fills with ``m.content``."""
    by_loop: dict[int, set[str]] = {}
    in_macros: set[int] = set()
    for macro in root.find_all(jinja2.nodes.Macro):
        params = [arg.name for arg in macro.args]
        bound: set[str] = set()
        for call in root.find_all(jinja2.nodes.Call):
            if not (isinstance(call.node, jinja2.nodes.Name) and call.node.name == macro.name):
                continue
            for i, arg in enumerate(call.args):
                if i < len(params) and any(_reads(arg, m, "content") for m in messages):
                    bound.add(params[i])
            for kw in call.kwargs:
                if kw.key in params and any(_reads(kw.value, m, "content") for m in messages):
                    bound.add(kw.key)
        for loop in macro.find_all(jinja2.nodes.For):
            in_macros.add(id(loop))
            if bound:
                by_loop[id(loop)] = bound
    return by_loop, in_macros


def _content_loops(root: jinja2.nodes.Template) -> Iterator[str]:
    """Loops over message content: ``for c in m.content``, over a macro parameter fed ``m.content``, or over
    a bare ``content`` outside macros. Lazily, in document order, as vLLM stops at the first.
    """
    messages = _message_names(root)
    by_loop, in_macros = _macro_content_params(root, messages)
    for loop in root.find_all(jinja2.nodes.For):
        if any(_reads(loop.iter, m, "content") for m in messages):
            yield _target(loop)
            continue
        if isinstance(loop.iter, jinja2.nodes.Name):
            name, params = loop.iter.name, by_loop.get(id(loop))
            fed = params is not None and name in params
            if fed or (params is None and id(loop) not in in_macros and name == "content"):
                yield _target(loop)


@lru_cache(maxsize=64)
def detect_content_format(template: str) -> Literal["string", "openai"]:
    """vLLM's ``auto`` content format: "openai" if the template loops over message content, else "string"
    (also when the template does not parse, or the search meets a loop it cannot follow).
    """
    try:
        root = _environment().parse(template)
        next(_content_loops(root))
    except StopIteration:
        return "string"
    except Exception:
        return "string"
    return "openai"
