"""Integer expressions over manifest vars, and the `buffer@offset` reference grammar (no eval)."""

from __future__ import annotations

import ast
import difflib
import functools
from collections.abc import Collection, Iterable, Mapping

# NOTE: every value a manifest computes is a size, count or offset that must fit an int64 on the
# device; bounding every intermediate also keeps messages short (no 4300-digit ints to format).
INT_LIMIT = 2**63
# NOTE: long enough for any real shape formula, short enough that nesting cannot exhaust the stack.
MAX_EXPR_CHARS = 256

EXPR_HELP = "an int or an integer expression over vars (ints, names, + - * // % and parentheses)"

_BINOPS: dict[type[ast.operator], str] = {
    ast.Add: "+",
    ast.Sub: "-",
    ast.Mult: "*",
    ast.FloorDiv: "//",
    ast.Mod: "%",
}


class ExprError(Exception):
    """An expression is malformed or cannot be evaluated; the caller adds the file and JSON path."""


def did_you_mean(word: str, choices: Iterable[str]) -> str:
    """`"; did you mean 'x'?"` when a choice is close to `word`, else `""`."""
    names = list(choices)
    # NOTE: a ratio of 0.6 needs len(word) <= 2.33 * len(choice); skipping longer words changes no
    # answer and keeps a multi-MB word from costing difflib seconds.
    if not names or len(word) > 3 * max(len(n) for n in names):
        return ""
    same_case = [n for n in names if n.lower() == word.lower()]  # `Go` for `go`: difflib's ratio is only 0.5
    close = same_case or difflib.get_close_matches(word, names, n=1, cutoff=0.6)
    return f"; did you mean '{close[0]}'?" if close else ""


def known_list(choices: Iterable[str]) -> str:
    """Names joined for a message, in the order given; `(none)` when there are none."""
    names = list(choices)
    return ", ".join(names) if names else "(none)"


@functools.lru_cache(maxsize=4096)
def parse_expr(text: str) -> ast.expr:
    """The checked syntax tree of `text`. Raises ExprError for anything outside the grammar."""
    if len(text) > MAX_EXPR_CHARS:
        raise ExprError(f"expression is {len(text)} characters; at most {MAX_EXPR_CHARS} are allowed")
    try:
        tree = ast.parse(text.strip(), mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        # ValueError: NUL bytes (3.11); the parser's own message says little to a manifest author.
        raise ExprError(f"expected {EXPR_HELP}, got {text!r}") from None
    _check_node(tree.body, text)
    return tree.body


def _check_node(node: ast.expr, text: str) -> None:
    if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
        _check_node(node.left, text)
        _check_node(node.right, text)
    elif isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        _check_node(node.operand, text)
    elif isinstance(node, ast.Constant) and type(node.value) is int:
        if abs(node.value) >= INT_LIMIT:
            raise ExprError(f"literal in {text!r} is out of range (|value| must be < 2**63)")
    elif isinstance(node, ast.Name):
        return
    else:
        raise ExprError(f"expected {EXPR_HELP}, got {text!r}")


def expr_names(text: str) -> frozenset[str]:
    """The names `text` refers to. Raises ExprError if `text` is not a valid expression."""
    return frozenset(n.id for n in ast.walk(parse_expr(text)) if isinstance(n, ast.Name))


def check_expr(text: str, known: Collection[str]) -> None:
    """Validate syntax and that every name is in `known`. Raises ExprError naming the unknown one."""
    for name in sorted(expr_names(text)):
        if name not in known:
            raise ExprError(
                f"unknown name '{name}' in expression {text!r}; known: {known_list(sorted(known))}"
                f"{did_you_mean(name, known)}"
            )


def eval_expr(value: int | str, env: Mapping[str, int]) -> int:
    """Evaluate an int or an expression string with `env` (name -> int).

    Division and modulo follow Python (floor). Raises ExprError on unknown names, division by zero,
    or a value (intermediate or final) with |value| >= 2**63.
    """
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise ExprError(f"expected {EXPR_HELP}, got {value!r}")
    if isinstance(value, int):
        return _bounded(value, str(value))
    node = parse_expr(value)
    try:
        return _eval(node, env, value)
    except RecursionError:
        raise ExprError(f"expression {value!r} is nested too deeply") from None


def _bounded(value: int, text: str) -> int:
    if abs(value) >= INT_LIMIT:
        raise ExprError(f"{text!r} is out of range: |value| must be < 2**63")
    return value


def _eval(node: ast.expr, env: Mapping[str, int], text: str) -> int:
    if isinstance(node, ast.Constant):
        assert isinstance(node.value, int)  # parse_expr admits int constants only
        return node.value
    if isinstance(node, ast.Name):
        if node.id not in env:
            raise ExprError(
                f"unknown name '{node.id}' in expression {text!r}; known: {known_list(sorted(env))}"
                f"{did_you_mean(node.id, env)}"
            )
        return env[node.id]
    if isinstance(node, ast.UnaryOp):
        operand = _eval(node.operand, env, text)
        return _bounded(-operand if isinstance(node.op, ast.USub) else operand, text)
    assert isinstance(node, ast.BinOp)  # parse_expr admits nothing else
    left = _eval(node.left, env, text)
    right = _eval(node.right, env, text)
    op = type(node.op)
    if op in (ast.FloorDiv, ast.Mod) and right == 0:
        values = ", ".join(f"{k}={env[k]}" for k in sorted(expr_names(text)) if k in env)
        where = f" ({values})" if values else ""
        raise ExprError(f"division by zero in {text!r}{where}")
    if op is ast.Add:
        result = left + right
    elif op is ast.Sub:
        result = left - right
    elif op is ast.Mult:
        result = left * right
    elif op is ast.FloorDiv:
        result = left // right
    else:
        result = left % right
    return _bounded(result, text)


def describe(value: int | str, env: Mapping[str, int]) -> str:
    """`"7168"` for an int; `"'tokens*hidden' with hidden=7168, tokens=4"` for an expression."""
    if isinstance(value, int):
        return str(value)
    try:
        names = sorted(expr_names(value))
    except ExprError:
        return repr(value)
    values = ", ".join(f"{k}={env[k]}" for k in names if k in env)
    return f"{value!r} with {values}" if values else repr(value)


def split_ref(text: str) -> tuple[str, str | None]:
    """Split `"buf@offset_expr"` into `("buf", "offset_expr")`; `"buf"` gives `("buf", None)`.

    The offset is in bytes from the start of the buffer.
    """
    name, sep, offset = text.partition("@")
    return (name, offset) if sep else (name, None)


PEERS_PREFIX = "peers:"
