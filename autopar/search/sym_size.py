"""Sizes written as text ("2*s0", "Min(32*s95, CeilToInt(FloatTrueDiv(2.0*ToFloat(32*s95), 4.0)))")
evaluated at the size symbols' example values, for the sharding ILP.

A captured graph's shapes are stored as text in `NodeInfo.shape` (passes/ir.py). Plain
arithmetic parses with sympy; a size that torch's symbolic shapes computed with its own
functions (an MoE capacity `min(N, ceil(cf * N * K / E))` prints as `CeilToInt(FloatTrueDiv(...))`)
does not: sympy reads those names as unknown functions and `float()` of the result fails. Here
every such name is given its plain meaning, and the symbols are replaced by their values before
anything is evaluated, so each function sees numbers.

Reads nothing from nodes (callers pass the shape); writes nothing. Guarantees: the value of a
size is a finite number or a ValueError naming the size, the symbols it lacks or the function
it cannot evaluate; memoised per (text, values).
"""
from __future__ import annotations

import functools
import math

import sympy

__all__ = ["numel", "size_value"]


def _num(x) -> sympy.Expr:
    return sympy.sympify(x)


def _float(x) -> float:
    return float(sympy.sympify(x))


# torch.utils._sympy.functions, by the names they print as, with their meaning on numbers
# (floor division, the Python modulo, ceil/floor/trunc/round to int, true division ...)
_FUNCTIONS = {
    "FloorDiv": lambda a, b: sympy.Integer(math.floor(_num(a) / _num(b))),
    "CeilDiv": lambda a, b: sympy.Integer(math.ceil(_num(a) / _num(b))),
    "CleanDiv": lambda a, b: _num(a) / _num(b),
    "IntTrueDiv": lambda a, b: sympy.Float(_float(a) / _float(b)),
    "FloatTrueDiv": lambda a, b: sympy.Float(_float(a) / _float(b)),
    "ModularIndexing": lambda x, d, m: sympy.Integer(math.floor(_num(x) / _num(d)) % int(m)),
    "PythonMod": lambda a, b: sympy.Integer(int(a) % int(b)),
    "Mod": lambda a, b: sympy.Integer(int(a) % int(b)),
    "CeilToInt": lambda x: sympy.Integer(math.ceil(_float(x))),
    "FloorToInt": lambda x: sympy.Integer(math.floor(_float(x))),
    "TruncToInt": lambda x: sympy.Integer(math.trunc(_float(x))),
    "TruncToFloat": lambda x: sympy.Float(math.trunc(_float(x))),
    "RoundToInt": lambda x: sympy.Integer(round(_float(x))),
    "RoundDecimal": lambda x, n: sympy.Float(round(_float(x), int(n))),
    "ToFloat": lambda x: sympy.Float(_float(x)),
    "Identity": lambda x: _num(x),
    "PowByNatural": lambda a, b: _num(a) ** _num(b),
    "FloatPow": lambda a, b: sympy.Float(_float(a) ** _float(b)),
    "LShift": lambda a, b: sympy.Integer(int(a) << int(b)),
    "RShift": lambda a, b: sympy.Integer(int(a) >> int(b)),
    "Where": lambda c, a, b: _num(a) if bool(c) else _num(b),
    "Min": sympy.Min,
    "Max": sympy.Max,
}


@functools.lru_cache(maxsize=4096)
def size_value(text: str, sym_items: tuple[tuple[str, int], ...]) -> float:
    """The value of one size written as text at the symbols' values `sym_items` ((name, value),
    sorted). Parsing with sympy is slow, and a deep model repeats the same few sizes thousands of
    times: memoised."""
    values = dict(sym_items)
    local = {**_FUNCTIONS, **{name: sympy.Integer(v) for name, v in values.items()}}
    try:
        r = sympy.sympify(text, locals=local)
    except (sympy.SympifyError, TypeError, ValueError, ZeroDivisionError, SyntaxError) as e:
        raise ValueError(f"size {text!r} cannot be evaluated at {values} ({type(e).__name__}: {e}); "
                         "capture with static shapes for the dims this size depends on") from e
    if isinstance(r, sympy.Basic) and r.free_symbols:
        missing = sorted(str(s) for s in r.free_symbols)
        raise ValueError(f"size {text!r} has no value for symbol(s) {missing} (values given: {values}); "
                         "pass them in sizes=")
    try:
        out = float(r)
    except TypeError as e:  # a function of torch's symbolic shapes not in _FUNCTIONS
        raise ValueError(f"size {text!r} uses a function the planner cannot evaluate ({r}); known: "
                         f"{sorted(_FUNCTIONS)}") from e
    if not math.isfinite(out):
        raise ValueError(f"size {text!r} is {out} at {values}")
    return out


def numel(shape, sym_vals) -> float:
    """Elements of a shape (ints and size texts) at `sym_vals` ({symbol name: value})."""
    if shape is None:
        return 0.0
    items = None
    total = 1.0
    for d in shape:
        if isinstance(d, int):
            total *= d
        else:
            items = items if items is not None else tuple(sorted(sym_vals.items()))
            total *= size_value(str(d), items)
    return total
