"""A small part of Python compiled to JavaScript, so that a browser runs kvjax's own arithmetic.

The calculator page (`kvjax plan --html FILE`) must compute what `kvjax plan` computes with no
server behind it, and never with a second implementation written by hand that could drift. So the
arithmetic is written once, in kvjax.accounting.formulas, in a part of Python whose meaning
JavaScript can keep exactly, and `compile_module` translates that file, statement by statement,
into one JavaScript expression: an object of the module's functions and constants.

What the part keeps, and how:
- ints are BigInt (`7` → `7n`), so byte counts stay exact past 2**53; `//` and `%` floor as
  Python's do; `/` gives a float (Number) as Python's true division does; `+` joins lists;
- floats are Number; None is null; str, list, tuple and dict (string keys) are their JavaScript
  kin; truth is Python's (an empty list or dict is false, `$.t`);
- f-strings with the format specs "", ",", ",.Nf" and ",.Ng", formatted exactly as Python does
  (from the float's exact binary value, ties to even: `$.fmt`);
- statements: assignment (to a name, a subscript or a tuple of names), `+=` and friends, `if`,
  `for` over a list or tuple, `return`, `raise Error(message)`, and calls of the module's own
  functions, of `max min abs int float len` and of an imported `cdiv`; `list.append`.
Anything else (keyword arguments, attribute access, a comprehension, ...) is refused with a
PyJsError naming the line, when the page is built, never silently mistranslated.

The runtime (`RUNTIME`, the `$` object) is Python's operator semantics in a few lines of JavaScript;
it holds no kvjax arithmetic.
"""
from __future__ import annotations

import ast
import inspect
import json
from types import ModuleType

from kvjax.errors import KvjaxError

_BUILTINS = {"max": "$.max", "min": "$.min", "abs": "$.abs", "int": "$.int", "float": "$.float", "len": "$.len"}
_HELPERS = {"cdiv": "$.cdiv"}  # imported names the runtime provides
_BINOPS = {ast.Sub: "-", ast.Mult: "*", ast.Pow: "**"}
_CALLED_BINOPS = {ast.Add: "$.add", ast.Div: "$.div", ast.FloorDiv: "$.floordiv", ast.Mod: "$.mod"}
_COMPARE = {ast.Eq: "==", ast.NotEq: "!=", ast.Lt: "<", ast.LtE: "<=", ast.Gt: ">", ast.GtE: ">=",
            ast.Is: "===", ast.IsNot: "!=="}


class PyJsError(KvjaxError):
    """Source outside the part of Python that compiles; the message names the line."""


RUNTIME = r"""const $ = {
  t(x) { if (Array.isArray(x)) return x.length > 0; if (x !== null && typeof x === "object") return Object.keys(x).length > 0; return Boolean(x); },
  big(a, b) { return typeof a === "bigint" && typeof b === "bigint"; },
  add(a, b) { return Array.isArray(a) ? a.concat(b) : a + b; },
  floordiv(a, b) {
    if (!$.big(a, b)) return Math.floor(Number(a) / Number(b));
    if (b === 0n) throw new Error("integer division by zero");
    let q = a / b; if (a % b !== 0n && (a < 0n) !== (b < 0n)) q -= 1n; return q; },
  mod(a, b) {
    if (!$.big(a, b)) { const r = Number(a) % Number(b); return r !== 0 && (r < 0) !== (b < 0) ? r + Number(b) : r; }
    let r = a % b; if (r !== 0n && (r < 0n) !== (b < 0n)) r += b; return r; },
  cdiv(a, b) { return -$.floordiv(-a, b); },
  div(a, b) { if (Number(b) === 0) throw new Error("division by zero"); return Number(a) / Number(b); },
  max(...xs) { return xs.reduce((m, x) => (x > m ? x : m)); },
  min(...xs) { return xs.reduce((m, x) => (x < m ? x : m)); },
  abs(x) { return x < 0 ? -x : x; },
  int(x) { return typeof x === "bigint" ? x : BigInt(Math.trunc(x)); },
  float(x) { return Number(x); },
  len(x) { return BigInt(x.length); },
  idx(i) { return typeof i === "bigint" ? Number(i) : i; },
  exact(x) {  // a finite double as [numerator, denominator] BigInts, exactly
    const v = new DataView(new ArrayBuffer(8)); v.setFloat64(0, x);
    const hi = v.getUint32(0), lo = v.getUint32(4), e = (hi >>> 20) & 0x7ff;
    let m = (BigInt(hi & 0xfffff) << 32n) | BigInt(lo);
    if (e) m |= 1n << 52n;
    const p = (e || 1) - 1075, s = hi >>> 31 ? -1n : 1n;
    return p >= 0 ? [s * (m << BigInt(p)), 1n] : [s * m, 1n << BigInt(-p)]; },
  round(n, d) { const q = n / d, r = n % d; return 2n * r > d || (2n * r === d && q % 2n === 1n) ? q + 1n : q; },
  group(s) { return s.replace(/\B(?=(\d{3})+(?!\d))/g, ","); },
  fixed(x, n, comma) {  // Python's format(x, ",.nf"): ties to even on the exact value
    let [num, den] = typeof x === "bigint" ? [x, 1n] : $.exact(x); const neg = num < 0n; if (neg) num = -num;
    const digits = String($.round(num * 10n ** BigInt(n), den)).padStart(n + 1, "0");
    const whole = digits.slice(0, digits.length - n), part = digits.slice(digits.length - n);
    return (neg ? "-" : "") + (comma ? $.group(whole) : whole) + (n ? "." + part : ""); },
  general(x, p, comma) {  // Python's format(x, ",.pg")
    if (x === 0 || x === 0n) return "0";
    let [num, den] = typeof x === "bigint" ? [x, 1n] : $.exact(x); const neg = num < 0n; if (neg) num = -num;
    let e = String(num / den).length - 1; if (num < den) { e = -1; while (num * 10n ** BigInt(-e) < den) e--; }
    const scale = (k) => k >= 0 ? [num, den * 10n ** BigInt(k)] : [num * 10n ** BigInt(-k), den];
    let m = $.round(...scale(e - p + 1)); if (m === 10n ** BigInt(p)) { e += 1; m = $.round(...scale(e - p + 1)); }
    const s = String(m), sign = neg ? "-" : "", dot = (w, f) => w + (f ? "." + f : "");
    if (e < -4 || e >= p) return sign + dot(s[0], s.slice(1).replace(/0+$/, "")) + $.exp(e);
    const w = e >= 0 ? s.slice(0, e + 1) : "0", f = (e >= 0 ? s.slice(e + 1) : "0".repeat(-e - 1) + s).replace(/0+$/, "");
    return sign + dot(comma ? $.group(w) : w, f); },
  exp(e) { return "e" + (e < 0 ? "-" : "+") + String(Math.abs(e)).padStart(2, "0"); },
  str(x) {
    if (x === null) return "None"; if (x === true) return "True"; if (x === false) return "False";
    if (typeof x !== "number") return String(x);
    if (!isFinite(x)) return isNaN(x) ? "nan" : (x > 0 ? "inf" : "-inf");
    const [d, e] = x.toExponential().split("e"), k = Number(e), ds = d.replace("-", "").replace(".", "");
    if (k < -4 || k >= 16) return d + $.exp(k);  // repr's shortest digits, placed as repr places them
    const sign = x < 0 ? "-" : "";
    if (k < 0) return sign + "0." + "0".repeat(-k - 1) + ds;
    return sign + ds.slice(0, k + 1).padEnd(k + 1, "0") + "." + (ds.slice(k + 1) || "0"); },
  fmt(x, spec) {
    const m = /^(,?)(?:\.(\d+)([fg]))?$/.exec(spec); if (!m) throw new Error("format spec " + spec);
    const comma = m[1] === ",";
    if (m[3] === "f") return $.fixed(x, Number(m[2]), comma);
    if (m[3] === "g") return $.general(x, Number(m[2]), comma);
    const s = $.str(x); if (!comma) return s;
    const [w, f] = s.split("."); return $.group(w) + (f !== undefined ? "." + f : ""); },
};"""


def compile_module(module: ModuleType) -> str:
    """The module as one JavaScript expression: an object of its functions and constants (and its
    error classes, which extend Error), the runtime inside it. PyJsError names a line outside the part."""
    return compile_source(inspect.getsource(module), module.__name__)


def compile_source(source: str, name: str) -> str:
    """compile_module of a module's source text, `name` naming it in errors."""
    return _Compiler(source, name).module()


class _Compiler:
    def __init__(self, source: str, name: str):
        self.tree, self.name = ast.parse(source), name
        self.functions: set[str] = set()
        self.errors: set[str] = set()
        self.helpers: dict[str, str] = {}

    def refuse(self, node: ast.AST, what: str) -> PyJsError:
        return PyJsError(f"{self.name} line {getattr(node, 'lineno', '?')}: {what} is outside the part of Python "
                         "kvjax.utils.pyjs compiles")

    def module(self) -> str:
        body, exported = [], []
        for node in self.tree.body:
            if isinstance(node, ast.FunctionDef):
                self.functions.add(node.name)
            elif isinstance(node, ast.ClassDef):
                self.errors.add(node.name)
        for node in self.tree.body:
            if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
                continue  # the docstring
            if isinstance(node, ast.ImportFrom):
                for alias in node.names:
                    if alias.name in _HELPERS:
                        self.helpers[alias.asname or alias.name] = _HELPERS[alias.name]
                continue  # other imports: the error base class, __future__
            if isinstance(node, ast.ClassDef):
                body.append(f"class {node.name} extends Error {{}}")
            elif isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
                body.append(f"const {node.targets[0].id} = {self.expr(node.value)};")
            elif isinstance(node, ast.FunctionDef):
                body.append(self.function(node))
            else:
                raise self.refuse(node, type(node).__name__)
            exported.append(node.targets[0].id if isinstance(node, ast.Assign) else node.name)
        return "(() => {\n" + RUNTIME + "\n" + "\n".join(body) + f"\nreturn {{{', '.join(exported)}}};\n}})()"

    def function(self, node: ast.FunctionDef) -> str:
        a = node.args
        if a.vararg or a.kwarg or a.kwonlyargs or a.defaults or a.posonlyargs or node.decorator_list:
            raise self.refuse(node, "a function with defaults, *args, keywords or decorators")
        params = [x.arg for x in a.args]
        local = sorted({t.id for n in ast.walk(node) if isinstance(n, (ast.Assign, ast.AugAssign))
                        for tgt in (n.targets if isinstance(n, ast.Assign) else [n.target])
                        for t in ast.walk(tgt) if isinstance(t, ast.Name)} - set(params))
        lines = [f"let {', '.join(local)};"] if local else []
        lines += self.block(node.body)
        return f"function {node.name}({', '.join(params)}) {{\n" + "\n".join("  " + x for x in lines) + "\n}"

    def block(self, stmts: list[ast.stmt]) -> list[str]:
        out = []
        for s in stmts:
            out += self.statement(s)
        return out

    def statement(self, s: ast.stmt) -> list[str]:
        if isinstance(s, ast.Expr):
            if isinstance(s.value, ast.Constant) and isinstance(s.value.value, str):
                return []  # a docstring
            return [self.expr(s.value) + ";"]
        if isinstance(s, ast.Assign):
            if len(s.targets) != 1:
                raise self.refuse(s, "a chained assignment")
            return [f"{self.target(s.targets[0])} = {self.expr(s.value)};"]
        if isinstance(s, ast.AugAssign):
            return [f"{self.target(s.target)} = {self.binop(s.op, self.expr(s.target), self.expr(s.value), s)};"]
        if isinstance(s, ast.Return):
            return ["return" + ("" if s.value is None else " " + self.expr(s.value)) + ";"]
        if isinstance(s, ast.If):
            out = [f"if ($.t({self.expr(s.test)})) {{", *("  " + x for x in self.block(s.body)), "}"]
            if s.orelse:
                out[-1] = "} else {"
                out += [*("  " + x for x in self.block(s.orelse)), "}"]
            return out
        if isinstance(s, ast.For):
            if s.orelse:
                raise self.refuse(s, "for ... else")
            return [f"for (const {self.target(s.target)} of {self.expr(s.iter)}) {{",
                    *("  " + x for x in self.block(s.body)), "}"]
        if isinstance(s, ast.Raise):
            call = s.exc
            if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Name) and call.func.id in self.errors):
                raise self.refuse(s, "raising anything but the module's own error class")
            return [f"throw {self.expr(call)};"]
        if isinstance(s, ast.Pass):
            return []
        raise self.refuse(s, type(s).__name__)

    def target(self, t: ast.expr) -> str:
        if isinstance(t, ast.Name):
            return t.id
        if isinstance(t, ast.Tuple) and all(isinstance(e, ast.Name) for e in t.elts):
            return "[" + ", ".join(e.id for e in t.elts) + "]"
        if isinstance(t, ast.Subscript):
            return self.expr(t)
        raise self.refuse(t, "this assignment target")

    def binop(self, op: ast.operator, left: str, right: str, node: ast.AST) -> str:
        if type(op) in _BINOPS:
            return f"({left} {_BINOPS[type(op)]} {right})"
        if type(op) in _CALLED_BINOPS:
            return f"{_CALLED_BINOPS[type(op)]}({left}, {right})"
        raise self.refuse(node, f"the operator {type(op).__name__}")

    def expr(self, e: ast.expr) -> str:
        if isinstance(e, ast.Constant):
            v = e.value
            if v is None or isinstance(v, bool):
                return {None: "null", True: "true", False: "false"}[v]
            if isinstance(v, int):
                return f"{v}n"
            if isinstance(v, float):
                return repr(v)
            if isinstance(v, str):
                return json.dumps(v, ensure_ascii=False)
            raise self.refuse(e, f"the constant {v!r}")
        if isinstance(e, ast.Name):
            return self.helpers.get(e.id, e.id)
        if isinstance(e, ast.BinOp):
            return self.binop(e.op, self.expr(e.left), self.expr(e.right), e)
        if isinstance(e, ast.UnaryOp):
            inner = self.expr(e.operand)
            if isinstance(e.op, ast.USub):
                return f"(-{inner})"
            if isinstance(e.op, ast.Not):
                return f"(!$.t({inner}))"
            if isinstance(e.op, ast.UAdd):
                return inner
            raise self.refuse(e, f"the operator {type(e.op).__name__}")
        if isinstance(e, ast.BoolOp):  # Python's value, not just its truth: `a or b` is a when a is true
            out = self.expr(e.values[-1])
            for v in reversed(e.values[:-1]):
                x = self.expr(v)
                out = f"($.t({x}) ? {out} : {x})" if isinstance(e.op, ast.And) else f"($.t({x}) ? {x} : {out})"
            return out
        if isinstance(e, ast.Compare):
            parts, left = [], self.expr(e.left)
            for op, right in zip(e.ops, e.comparators):
                if type(op) not in _COMPARE:
                    raise self.refuse(e, f"the comparison {type(op).__name__}")
                r = self.expr(right)
                parts.append(f"({left} {_COMPARE[type(op)]} {r})")
                left = r
            return parts[0] if len(parts) == 1 else "(" + " && ".join(parts) + ")"
        if isinstance(e, ast.IfExp):
            return f"($.t({self.expr(e.test)}) ? {self.expr(e.body)} : {self.expr(e.orelse)})"
        if isinstance(e, ast.Call):
            return self.call(e)
        if isinstance(e, ast.Subscript):
            return f"{self.expr(e.value)}[$.idx({self.expr(e.slice)})]"
        if isinstance(e, (ast.List, ast.Tuple)):
            return "[" + ", ".join(self.expr(x) for x in e.elts) + "]"
        if isinstance(e, ast.Dict):
            if not all(isinstance(k, ast.Constant) and isinstance(k.value, str) for k in e.keys):
                raise self.refuse(e, "a dict whose keys are not string constants")
            return "{" + ", ".join(f"{json.dumps(k.value)}: {self.expr(v)}" for k, v in zip(e.keys, e.values)) + "}"
        if isinstance(e, ast.JoinedStr):
            parts = []
            for v in e.values:
                if isinstance(v, ast.Constant):
                    parts.append(json.dumps(v.value, ensure_ascii=False))
                elif isinstance(v, ast.FormattedValue) and v.conversion == -1:
                    spec = ""
                    if v.format_spec is not None:
                        if not all(isinstance(x, ast.Constant) for x in v.format_spec.values):
                            raise self.refuse(e, "a computed format spec")
                        spec = "".join(x.value for x in v.format_spec.values)
                    parts.append(f"$.fmt({self.expr(v.value)}, {json.dumps(spec)})")
                else:
                    raise self.refuse(e, "an f-string conversion (!r, !s)")
            return "(" + " + ".join(parts or ['""']) + ")"
        raise self.refuse(e, type(e).__name__)

    def call(self, e: ast.Call) -> str:
        if e.keywords:
            raise self.refuse(e, "a call with keyword arguments")
        args = ", ".join(self.expr(a) for a in e.args)
        f = e.func
        if isinstance(f, ast.Attribute) and f.attr == "append" and len(e.args) == 1:
            return f"{self.expr(f.value)}.push({args})"
        if isinstance(f, ast.Name):
            if f.id in self.errors:
                return f"new {f.id}({args})"
            if f.id in self.functions:
                return f"{f.id}({args})"
            if f.id in self.helpers:
                return f"{self.helpers[f.id]}({args})"
            if f.id in _BUILTINS:
                return f"{_BUILTINS[f.id]}({args})"
        raise self.refuse(e, f"calling {ast.unparse(f)}")
