"""Render chat prompts by splicing message contents into a template rendered once per structure.

``tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)``
runs the Jinja template on every call (~35 us for a one-message chat).  Most
templates copy each message's ``content`` into the output verbatim, between
literal text that depends only on the *structure* of the chat (the roles and
other fields, how many messages).  :func:`render_chat` renders each structure
once with probe contents, and when the probes prove that the template copies
the contents verbatim, later chats of that structure are the literal segments
joined with their contents (~2 us), the same string ``apply_chat_template``
returns.

What proves it, checked once per structure (else that structure is always
rendered in full, as before):

* **Nothing looks at the content.**  The template is rendered with probe
  contents that record every use other than being written to the output:
  any method, comparison, ``in`` test, length or truthiness beyond non-emptiness,
  item access, iteration, hashing, ``%`` formatting, and ``str()`` outside the
  template's own output statements (the ``~`` operator, ``|join``, ``|string``
  in a filter); ``+`` keeps the mark on the result.  Any recorded use (a
  ``|trim``, ``'</think>' in content``, ``content.startswith(...)``) means the
  output may depend on the content other than by copying it.
* **The output is a copy.**  Two renders through ``apply_chat_template`` itself,
  with two different sets of probe contents (leading and trailing whitespace,
  newlines, quotes, backslashes, braces, ``<&>``, non-ASCII), must be the same
  literal segments around the probes (a ``|tojson`` or an escape changes the
  probe's characters and fails this), and the recording render must equal the
  first of them (it calls the same compiled template with the same arguments).
* **The template's syntax allows it** (checked on its parsed source): no
  ``strftime_now`` (the date, in Llama 3.1's), ``random`` filter or ``lipsum``; and
  nothing the probes cannot observe: a content given to C string code as an
  argument (``x in 'text'`` with a variable ``x``, a method call, filter or test
  with variable arguments), a ``tojson`` result used other than written out, or
  output captured as a string (macros, ``call``/``filter``/``set`` blocks).

Only chats whose messages are dicts of ``str``/``int``/``float``/``bool``
values with a non-empty ``str`` ``content`` are spliced; the key of a structure
holds every other field, the keyword arguments, and the template.  A change of
the tokenizer's chat template or special tokens starts a new cache.
"""

from __future__ import annotations

import sys
import weakref
from typing import Any

from .._collated import check_messages

__all__ = ["render_chat"]

#: structures kept per tokenizer (a dict cleared when full: structures are few in practice)
MAX_STRUCTURES = 256

#: fields transformers copies under other names before rendering (``_alias_reasoning_fields``)
_ALIASED = frozenset({"reasoning_content", "reasoning", "thinking"})
_PLAIN = (str, int, float, bool)
_OUTPUT_FILENAME = "<template>"  # the filename Jinja gives a template compiled from a string


class _Uses:
    """What a recording render saw: set when a probe was used other than copied."""

    __slots__ = ("touched",)

    def __init__(self) -> None:
        self.touched: list[str] = []


def _recording_method(name: str) -> Any:
    base = getattr(str, name)

    def method(self: Any, *args: Any, **kwargs: Any) -> Any:
        object.__getattribute__(self, "_uses").touched.append(name)
        return base(self, *args, **kwargs)

    method.__name__ = name
    return method


class _Probe(str):
    """A probe content: records every use but output (see the module docstring)."""

    _uses: _Uses

    def __new__(cls, text: str, uses: _Uses) -> _Probe:
        probe = super().__new__(cls, text)
        object.__setattr__(probe, "_uses", uses)
        return probe

    def __getattribute__(self, name: str) -> Any:
        if name != "__class__":  # isinstance() reads __class__; the sandbox reads methods by name
            object.__getattribute__(self, "_uses").touched.append(name)
        return object.__getattribute__(self, name)

    def __str__(self) -> str:
        if sys._getframe(1).f_code.co_filename != _OUTPUT_FILENAME:  # str() in a filter, ``~``, a join
            object.__getattribute__(self, "_uses").touched.append("__str__")
        return str.__str__(self)

    def __bool__(self) -> bool:  # probes and spliced contents are all non-empty
        return True

    def __add__(self, other: Any) -> Any:
        if not isinstance(other, str):
            return NotImplemented
        return _Probe(str.__add__(self, other), object.__getattribute__(self, "_uses"))

    def __radd__(self, other: Any) -> Any:
        if not isinstance(other, str):
            return NotImplemented
        return _Probe(str.__add__(other, self), object.__getattribute__(self, "_uses"))


for _name in ("__contains__", "__eq__", "__ne__", "__lt__", "__le__", "__gt__", "__ge__", "__hash__", "__len__",
              "__getitem__", "__iter__", "__mul__", "__rmul__", "__mod__", "__rmod__", "__format__", "__repr__",
              "__reduce__", "__reduce_ex__", "__getnewargs__", "__sizeof__", "__setattr__", "__delattr__", "__dir__"):
    setattr(_Probe, _name, _recording_method(_name))
del _name


def _probe_texts(count: int, variant: int) -> list[str]:
    """Distinct probe contents, unlike any template text, with the characters a
    template could change: surrounding whitespace, newlines, quotes, escapes, non-ASCII."""
    if variant == 0:
        return [f" \n\t\u2063probe{i}:A \"q\" 'x' \\ {{{{%}}}} <&> \u00e9\u4e2d\U0001f600\u2063 \n " for i in range(count)]
    return [f"\r\n\u2064P{i}b\u2064\t" for i in range(count)]


class _Splicer:
    """The literal segments of one structure: ``segments[0] + c0 + segments[1] + ... + segments[n]``."""

    __slots__ = ("segments",)

    def __init__(self, segments: list[str]) -> None:
        self.segments = segments

    def join(self, contents: list[str]) -> str:
        segments = self.segments
        parts = [segments[0]]
        for content, segment in zip(contents, segments[1:]):
            parts.append(content)
            parts.append(segment)
        return "".join(parts)


def _segments(text: str, probes: list[str]) -> list[str] | None:
    """``text`` cut around ``probes`` (each found once, in order), or None."""
    segments, pos = [], 0
    for probe in probes:
        found = text.find(probe, pos)
        if found < 0:
            return None
        segments.append(text[pos:found])
        pos = found + len(probe)
    segments.append(text[pos:])
    return segments


#: statements that capture rendered output as a string (which could then be inspected unseen)
#: or bring in other templates
_CAPTURING = ("Macro", "CallBlock", "FilterBlock", "AssignBlock", "Block", "Extends", "Include", "Import",
              "FromImport")


def _static_check(compiled: Any) -> bool:
    """True when the template's syntax lets the probes see every use of a content
    (see the module docstring); False for templates that may render differently for
    the same inputs (the date, randomness) or may look at a content through code that
    the probes cannot observe: C string functions given a content as an argument
    (``x in 'text'``, ``'a'.join(...)``, a filter or test with variable arguments), a
    ``tojson`` whose result is not written out directly, output captured as a string
    (macros, call/filter/set blocks)."""
    import jinja2.nodes as nodes

    try:
        ast = compiled.environment.parse(_source(compiled))
    except Exception:
        return False
    parents: dict[int, Any] = {}
    for node in ast.find_all(nodes.Node):
        for child in node.iter_child_nodes():
            parents[id(child)] = node
    capturing = tuple(getattr(nodes, name) for name in _CAPTURING)
    for node in ast.find_all(nodes.Node):
        if isinstance(node, capturing):
            return False
        if isinstance(node, nodes.Name) and node.name in ("strftime_now", "lipsum"):
            return False
        if isinstance(node, nodes.Compare):
            left = node.expr
            for operand in node.ops:
                if (operand.op in ("in", "notin") and not isinstance(left, nodes.Const)
                        and not isinstance(operand.expr, (nodes.List, nodes.Tuple, nodes.Dict))):
                    return False
                left = operand.expr
        elif isinstance(node, (nodes.Call, nodes.Filter, nodes.Test)):
            if isinstance(node, nodes.Filter) and node.name == "random":
                return False
            arguments = [*node.args, *(k.value for k in node.kwargs), node.dyn_args, node.dyn_kwargs]
            variable = any(arg is not None and not isinstance(arg, nodes.Const) for arg in arguments)
            if variable and (not isinstance(node, nodes.Call) or isinstance(node.node, nodes.Getattr)):
                return False  # a method or filter that may get a content as an argument
            if isinstance(node, nodes.Filter) and node.name == "tojson":
                parent = parents.get(id(node))
                while isinstance(parent, (nodes.Add, nodes.Concat)):
                    parent = parents.get(id(parent))
                if not isinstance(parent, nodes.Output):
                    return False  # its result may be looked at
    return True


def _source(compiled: Any) -> str:
    return compiled._chat_splice_source  # set by _compile


def _compile(source: str) -> Any:
    """transformers' own compiled template (its cached compile), or None when unavailable."""
    try:
        from transformers.utils.chat_template_utils import _compile_jinja_template
    except ImportError:  # pragma: no cover - another transformers layout: always render in full
        return None
    compiled = _compile_jinja_template(source)
    try:
        compiled._chat_splice_source = source
    except AttributeError:  # pragma: no cover
        return None
    return compiled


class _TokenizerCache:
    """One tokenizer's spliceable structures, valid for one template and special-token map."""

    __slots__ = ("compiled", "checked", "source", "special", "structures")

    def __init__(self, source: str, special: dict[str, Any]) -> None:
        self.source = source
        self.special = special
        self.compiled: Any = None
        self.checked: bool | None = None  # the static check passed (None: not run yet)
        self.structures: dict[Any, _Splicer | None] = {}


_CACHES: weakref.WeakKeyDictionary[Any, _TokenizerCache] = weakref.WeakKeyDictionary()


def _structure(messages: Any) -> tuple[tuple[Any, ...], list[str]] | None:
    """The chat's structure key (its messages' fields, each content's place marked) and its
    contents, or None when the chat is not spliceable."""
    if type(messages) is not list or not messages:
        return None
    key: list[Any] = []
    contents: list[str] = []
    for message in messages:
        if type(message) is not dict:
            return None
        content = message.get("content")
        if type(content) is not str or not content:
            return None
        fields: list[Any] = []
        for name, value in message.items():
            if type(name) is not str or name in _ALIASED:
                return None
            if name == "content":
                fields.append(name)
            elif type(value) in _PLAIN:
                fields.append((name, type(value), value))
            else:  # None (dropped by transformers), lists, objects
                return None
        key.append(tuple(fields))
        contents.append(content)
    return tuple(key), contents


def _with_contents(messages: list[dict[str, Any]], contents: list[Any]) -> list[dict[str, Any]]:
    return [{**message, "content": content} for message, content in zip(messages, contents)]


def _build(tokenizer: Any, cache: _TokenizerCache, messages: list[dict[str, Any]],
           kwargs: dict[str, Any]) -> _Splicer | None:
    """Probe one structure (see the module docstring): its splicer, or None to render in full."""
    if cache.checked is None:
        cache.compiled = _compile(cache.source)
        cache.checked = cache.compiled is not None and _static_check(cache.compiled)
    if not cache.checked:
        return None
    n = len(messages)
    first, second = _probe_texts(n, 0), _probe_texts(n, 1)
    try:
        text = tokenizer.apply_chat_template(_with_contents(messages, first), tokenize=False,
                                             add_generation_prompt=True, **kwargs)
        other = tokenizer.apply_chat_template(_with_contents(messages, second), tokenize=False,
                                              add_generation_prompt=True, **kwargs)
        uses = _Uses()
        probes = [_Probe(t, uses) for t in first]
        recorded = cache.compiled.render(messages=_with_contents(messages, probes), tools=None, documents=None,
                                         add_generation_prompt=True, **{**cache.special, **kwargs})
    except Exception:  # the template refuses the probes: render in full (and raise there, if it does)
        return None
    if uses.touched or type(text) is not str or recorded != text:
        return None
    segments = _segments(text, first)
    if segments is None or _Splicer(segments).join(second) != other:
        return None
    return _Splicer(segments)


def render_chat(tokenizer: Any, messages: Any, **kwargs: Any) -> str:
    """``tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kwargs)``,
    spliced when the template copies the contents verbatim (see the module docstring).

    Args:
        tokenizer: a transformers tokenizer with a chat template.
        messages: the chat (list of message dicts).
        kwargs: template variables (``enable_thinking=``); plain values only are spliced.

    Returns:
        The rendered prompt, exactly ``apply_chat_template``'s string.

    Raises:
        DatasetError: a message's role or content is not a string (a default-collated
            batch; :func:`engine.chat.check_messages`), checked when a chat is not
            spliced and once per spliced structure.
        What ``apply_chat_template`` raises (the chat is then rendered by it).
    """
    found = _structure(messages)
    if found is None:
        check_messages(messages, "render_chat")
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kwargs)
    key, contents = found
    if kwargs:
        variables = []
        for name, value in kwargs.items():
            if value is not None and type(value) not in _PLAIN:
                return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kwargs)
            variables.append((name, type(value), value))
        variables.sort(key=_first)
        key = (key, tuple(variables))
    try:
        source = tokenizer.get_chat_template(None, None)
        special = tokenizer.special_tokens_map
        cache = _CACHES.get(tokenizer)
        if cache is None or (cache.source is not source and cache.source != source) or cache.special != special:
            cache = _CACHES[tokenizer] = _TokenizerCache(source, special)
    except Exception:  # no template (raised again below), not weak-referenceable
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kwargs)
    structures = cache.structures
    try:
        splicer = structures[key]
    except KeyError:
        check_messages(messages, "render_chat")  # once per structure (its roles are in the key)
        if len(structures) >= MAX_STRUCTURES:
            structures.clear()
        splicer = structures[key] = _build(tokenizer, cache, messages, kwargs)
    if splicer is None:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kwargs)
    return splicer.join(contents)


def _first(item: tuple[Any, ...]) -> Any:
    return item[0]
