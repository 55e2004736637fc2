"""Receiver-side filters: a subscription's selector on headers and envelope fields.

A handler may declare ``selector = "..."``; the receiver then stores only the messages
of its type the selector matches, and acks and counts the others without storing them
(docs/explanation/receive.md, "Expiry and filters"). The language is a small part of SQL's
(as JMS message selectors are)::

    expr    := and ( OR and )*
    and     := not ( AND not )*
    not     := NOT not | primary
    primary := '(' expr ')' | EXISTS field
             | field ( = | <> | != | < | <= | > | >= ) literal
             | field [NOT] IN '(' literal ( ',' literal )* ')'
    field   := name ( '.' name | '[' string ']' )*
    literal := 'text' (a quote doubled inside) | number | TRUE | FALSE

Keywords are case-insensitive. A field starts at one of :data:`ROOTS`: an envelope field
(``message_type``, ``aggregate_id``...), the delivery's ``routing_key``, or a path into
``headers``, ``message_context`` or ``payload`` (``headers['x-tenant']``,
``message_context.tenant``, ``payload.address.country``).

Logic is SQL's three-valued one: a comparison with a missing field, or with a value of
another type (a number with text), is *unknown*; ``NOT unknown`` is unknown; a message
matches only when the whole selector is true. ``EXISTS f`` is true when ``f`` is present
and not null.

Hostile input: the selector is parsed once, at start (:func:`parse`, errors give the
position). Evaluating it reads only the fields it names, each by a path of fixed length,
whatever the depth of a header table or payload; a comparison touches at most the
shorter of its two values, and ``IN`` is one hash lookup. Time is linear in the
selector's size times the size of the values compared, which the broker's frame and the
receiver's body limit bound. No regular expression runs on message data.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

from framework.errors import SelectorError

#: Longest selector text, and deepest nesting of parentheses and NOTs, accepted.
MAX_SELECTOR_CHARS = 4096
MAX_NESTING = 32

#: Fields a selector can name: scalar ones, then the roots of paths.
SCALAR_FIELDS = (
    "message_id",
    "message_type",
    "message_version",
    "aggregate_type",
    "aggregate_id",
    "timestamp",
    "routing_key",
)
PATH_ROOTS = ("headers", "message_context", "payload")
ROOTS = SCALAR_FIELDS + PATH_ROOTS

_KEYWORDS = frozenset({"AND", "OR", "NOT", "IN", "EXISTS", "TRUE", "FALSE"})
_OPERATORS = ("<=", ">=", "<>", "!=", "=", "<", ">")
# Tokens of the selector text (the developer's, bounded by MAX_SELECTOR_CHARS): whitespace,
# a quoted string, a number, a name, an operator, punctuation.
_TOKEN = re.compile(
    r"""(?P<space>\s+)
      | (?P<string>'(?:[^']|'')*')
      | (?P<number>-?(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?)
      | (?P<name>[A-Za-z_][A-Za-z0-9_]*)
      | (?P<op><=|>=|<>|!=|=|<|>)
      | (?P<punct>[().,\[\]])""",
    re.VERBOSE,
)

Value = str | int | float | Decimal | bool
# Three-valued truth: True, False, or None for unknown.
Truth = bool | None


@dataclass(frozen=True)
class Fields:
    """What a selector sees of one message (the receiver builds it after validation)."""

    envelope: Mapping[str, Any]
    headers: Mapping[str, Any]
    routing_key: str

    def root(self, name: str) -> Any:
        if name == "routing_key":
            return self.routing_key
        if name == "headers":
            return self.headers
        return self.envelope.get(name)


Node = Callable[[Fields], Truth]


@dataclass(frozen=True)
class _Token:
    kind: str
    text: str
    position: int


class Selector:
    """A parsed selector; :meth:`matches` is true only when the selector is true for the message."""

    def __init__(self, text: str, node: Node) -> None:
        self.text = text
        self._node = node

    def matches(self, fields: Fields) -> bool:
        return self._node(fields) is True

    def __repr__(self) -> str:
        return f"Selector({self.text!r})"


def parse(text: str) -> Selector:
    """Parse ``text``; raises SelectorError naming the position (counted from 1) of the problem."""
    if not isinstance(text, str):
        raise SelectorError(f"a selector is text, not {type(text).__name__}")
    if len(text) > MAX_SELECTOR_CHARS:
        raise SelectorError(f"a selector holds at most {MAX_SELECTOR_CHARS} characters, this one {len(text)}")
    parser = _Parser(text, _tokens(text))
    node = parser.expression(0)
    parser.expect_end()
    return Selector(text, node)


def _tokens(text: str) -> list[_Token]:
    out: list[_Token] = []
    at = 0
    while at < len(text):
        match = _TOKEN.match(text, at)
        if match is None:
            raise SelectorError(f"unexpected character {text[at]!r} at position {at + 1} of {text!r}")
        kind = match.lastgroup or ""
        if kind != "space":
            out.append(_Token(kind, match.group(), at + 1))
        at = match.end()
    out.append(_Token("end", "", len(text) + 1))
    return out


class _Parser:
    def __init__(self, text: str, tokens: list[_Token]) -> None:
        self.text = text
        self.tokens = tokens
        self.at = 0

    # --- tokens -----------------------------------------------------------------------

    def peek(self) -> _Token:
        return self.tokens[self.at]

    def take(self) -> _Token:
        token = self.tokens[self.at]
        if token.kind != "end":
            self.at += 1
        return token

    def keyword(self, word: str) -> bool:
        token = self.peek()
        if token.kind == "name" and token.text.upper() == word:
            self.at += 1
            return True
        return False

    def punct(self, char: str) -> bool:
        token = self.peek()
        if token.kind == "punct" and token.text == char:
            self.at += 1
            return True
        return False

    def fail(self, expected: str) -> SelectorError:
        token = self.peek()
        found = "the end" if token.kind == "end" else repr(token.text)
        return SelectorError(f"expected {expected} at position {token.position} of {self.text!r}, found {found}")

    def expect_end(self) -> None:
        if self.peek().kind != "end":
            raise self.fail("AND, OR or the end")

    # --- grammar ----------------------------------------------------------------------

    def expression(self, depth: int) -> Node:
        if depth > MAX_NESTING:
            raise self.fail(f"at most {MAX_NESTING} levels of parentheses and NOT")
        parts = [self.conjunction(depth)]
        while self.keyword("OR"):
            parts.append(self.conjunction(depth))
        return parts[0] if len(parts) == 1 else _junction(parts, decisive=True)

    def conjunction(self, depth: int) -> Node:
        parts = [self.negation(depth)]
        while self.keyword("AND"):
            parts.append(self.negation(depth))
        return parts[0] if len(parts) == 1 else _junction(parts, decisive=False)

    def negation(self, depth: int) -> Node:
        if self.keyword("NOT"):
            if depth + 1 > MAX_NESTING:
                raise self.fail(f"at most {MAX_NESTING} levels of parentheses and NOT")
            return _not(self.negation(depth + 1))
        return self.primary(depth)

    def primary(self, depth: int) -> Node:
        if self.punct("("):
            node = self.expression(depth + 1)
            if not self.punct(")"):
                raise self.fail("')'")
            return node
        if self.keyword("EXISTS"):
            return _exists(self.field())
        path = self.field()
        negated = self.keyword("NOT")
        if self.keyword("IN"):
            return _in(path, self.literals(), negated)
        if negated:
            raise self.fail("IN after NOT")
        token = self.peek()
        if token.kind != "op":
            raise self.fail("a comparison (=, <>, <, <=, >, >=), IN or NOT IN")
        self.take()
        return _compare(path, "<>" if token.text == "!=" else token.text, self.literal())

    def field(self) -> tuple[str, tuple[str, ...]]:
        token = self.peek()
        if token.kind != "name" or token.text.upper() in _KEYWORDS:
            raise self.fail(f"a field ({', '.join(ROOTS)})")
        if token.text not in ROOTS:
            raise self.fail(f"a field ({', '.join(ROOTS)})")
        self.take()
        path: list[str] = []
        while True:
            if self.punct("."):
                name = self.peek()
                if name.kind != "name":
                    raise self.fail("a name after '.'")
                path.append(self.take().text)
            elif self.punct("["):
                key = self.peek()
                if key.kind != "string":
                    raise self.fail("a quoted name inside '[ ]'")
                path.append(_unquote(self.take().text))
                if not self.punct("]"):
                    raise self.fail("']'")
            else:
                break
        if token.text in SCALAR_FIELDS and path:
            raise SelectorError(f"{token.text} at position {token.position} of {self.text!r} has no fields inside")
        if token.text in PATH_ROOTS and not path:
            raise SelectorError(
                f"{token.text} at position {token.position} of {self.text!r} needs a name: "
                f"{token.text}.name or {token.text}['x-name']"
            )
        return token.text, tuple(path)

    def literal(self) -> Value:
        token = self.peek()
        if token.kind == "string":
            value: Value = _unquote(token.text)
        elif token.kind == "number":
            value = float(token.text) if any(c in token.text for c in ".eE") else int(token.text)
        elif token.kind == "name" and token.text.upper() in ("TRUE", "FALSE"):
            value = token.text.upper() == "TRUE"
        else:
            raise self.fail("a literal ('text', a number, TRUE or FALSE)")
        self.take()
        return value

    def literals(self) -> list[Value]:
        if not self.punct("("):
            raise self.fail("'(' after IN")
        values = [self.literal()]
        while self.punct(","):
            values.append(self.literal())
        if not self.punct(")"):
            raise self.fail("',' or ')'")
        return values


def _unquote(text: str) -> str:
    return text[1:-1].replace("''", "'")


# --- evaluation -------------------------------------------------------------------------

_MISSING = object()


def _lookup(fields: Fields, path: tuple[str, tuple[str, ...]]) -> Any:
    """The value at ``path``: one step per name of the path, whatever lies deeper."""
    root, keys = path
    value = fields.root(root)
    for key in keys:
        if not isinstance(value, Mapping):
            return _MISSING
        value = value.get(key, _MISSING)
    return _MISSING if value is None else value


def _kind(value: Any) -> str:
    """The comparison class of a value: text, number, boolean, or none (cannot be compared)."""
    if isinstance(value, str):
        return "text"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int | float | Decimal):
        return "number"
    return ""


_COMPARE: dict[str, Callable[[Any, Any], bool]] = {
    "=": lambda a, b: bool(a == b),
    "<>": lambda a, b: bool(a != b),
    "<": lambda a, b: bool(a < b),
    "<=": lambda a, b: bool(a <= b),
    ">": lambda a, b: bool(a > b),
    ">=": lambda a, b: bool(a >= b),
}


def _compare(path: tuple[str, tuple[str, ...]], op: str, literal: Value) -> Node:
    test = _COMPARE[op]
    want = _kind(literal)
    if want == "boolean" and op not in ("=", "<>"):
        raise SelectorError(f"TRUE and FALSE compare with = and <> only, not {op}")

    def node(fields: Fields) -> Truth:
        value = _lookup(fields, path)
        if _kind(value) != want:
            return None
        try:
            return test(value, literal)
        except ArithmeticError:  # a Decimal NaN from a header
            return None

    return node


def _in(path: tuple[str, tuple[str, ...]], literals: list[Value], negated: bool) -> Node:
    # One set per comparison class, so that 1 never equals TRUE and '1' never equals 1.
    by_kind: dict[str, frozenset[Any]] = {}
    for literal in literals:
        kind = _kind(literal)
        by_kind[kind] = by_kind.get(kind, frozenset()) | {literal}

    def node(fields: Fields) -> Truth:
        value = _lookup(fields, path)
        kind = _kind(value)
        if not kind:
            return None
        try:
            found = value in by_kind.get(kind, frozenset())
        except (ArithmeticError, TypeError):  # a Decimal signalling NaN is unhashable
            return None
        return found != negated

    return node


def _exists(path: tuple[str, tuple[str, ...]]) -> Node:
    return lambda fields: _lookup(fields, path) is not _MISSING


def _not(inner: Node) -> Node:
    def node(fields: Fields) -> Truth:
        value = inner(fields)
        return None if value is None else not value

    return node


def _junction(parts: list[Node], *, decisive: bool) -> Node:
    """AND (``decisive`` False) or OR (True) in three-valued logic: the first part that is
    ``decisive`` decides; else unknown if any part was unknown; else ``not decisive``."""

    def node(fields: Fields) -> Truth:
        result: Truth = not decisive
        for part in parts:
            value = part(fields)
            if value is decisive:
                return decisive
            if value is None:
                result = None
        return result

    return node
