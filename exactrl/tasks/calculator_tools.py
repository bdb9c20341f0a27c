"""The calculator task's tool, for ``env.tools=exactrl.tasks.calculator_tools``: this module's only public name is
the tool, since the tool-calling environment offers the model every public function of the module it is given.

The expression is parsed by hand (integers, + - *, the usual precedence), never eval()'d: the model writes it.
"""

__all__ = ["calc"]

_MAX_CHARS = 200  # bounds the result (a product of n digits has at most n digits) and the work


def calc(expr: str) -> str:
    """Evaluate an integer arithmetic expression.

    Args:
        expr: Integers joined by +, - and *, e.g. "347+285" or "12*3-4"; * binds tighter than + and -.

    Returns:
        The value, as a decimal integer.
    """
    if not isinstance(expr, str):
        raise ValueError(f"calc: expr must be a string, got {type(expr).__name__}")
    if len(expr) > _MAX_CHARS:
        raise ValueError(f"calc: expr of {len(expr)} characters; at most {_MAX_CHARS}")
    tokens = _tokens(expr)
    total, sign, product, expect_number = 0, 1, 1, True
    for tok in tokens:  # sum of signed products: * folds into the product, + and - close it
        if expect_number != isinstance(tok, int):
            raise ValueError(f"calc: cannot read {expr!r}: expected {'a number' if expect_number else 'an operator'}")
        if isinstance(tok, int):
            product *= tok
        elif tok in "+-":
            total, sign, product = total + sign * product, 1 if tok == "+" else -1, 1
        expect_number = not expect_number
    if expect_number:
        raise ValueError(f"calc: cannot read {expr!r}: it ends with an operator" if tokens else "calc: expr is empty")
    return str(total + sign * product)


def _tokens(expr: str) -> list:
    """Integers and the operators + - *, whitespace skipped; anything else refused."""
    out, i = [], 0
    while i < len(expr):
        c = expr[i]
        if c in "0123456789":
            j = i
            while j < len(expr) and expr[j] in "0123456789":
                j += 1
            out.append(int(expr[i:j]))
            i = j
            continue
        if c not in "+-* \t":
            raise ValueError(f"calc: {c!r} in {expr!r}: only integers, +, - and * are allowed")
        if c in "+-*":
            out.append(c)
        i += 1
    return out
