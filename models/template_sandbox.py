"""The bounded Jinja sandbox a model file's chat template renders in: limits on time, size and depth.

A chat template is code that comes with the model file (a GGUF's `tokenizer.chat_template`, a
folder's chat_template.jinja or tokenizer_config.json), so it renders as transformers renders it
(`_compile_jinja_template`: jinja2's `ImmutableSandboxedEnvironment`, which keeps it from
reaching Python's internals or changing the caller's data) and, beyond that sandbox, within
bounds, so that a hostile or broken template is one `ChatTemplateLimitError` naming its source
file rather than a hang, a RecursionError or a machine out of memory:

- work: every Python call and every line of template code a render runs is a step (a tracer,
  `sys.settrace`, for the render's duration); more than MAX_TEMPLATE_STEPS steps, or more than
  MAX_TEMPLATE_SECONDS of wall clock, is refused. A nested `range(100000)` loop is refused after
  about a second; SmolLM2's ChatML template takes about 50 steps a message.
- source: at most MAX_TEMPLATE_SOURCE characters of template, so that compiling it is bounded too.
- depth: at most MAX_TEMPLATE_DEPTH nested template frames (a macro calling itself, a recursive
  `loop(...)`); a RecursionError from deeper Python code is refused the same way.
- size: the rendered text, and every string, list or number a template builds, stay under
  MAX_TEMPLATE_CHARS characters (items; MAX_INT_BITS bits for an integer). What multiplies a size
  is checked *before* it runs: `*`, `**`, `%`, `+` and `~`; joining a macro's or a block's output;
  `{{ value }}` of a container (its text bounded by `_text_bound`); the filters and str methods
  that pad, repeat, replace, join or format (a width or count above MAX_TEMPLATE_CHARS given to
  center, indent, batch, ljust, zfill, int.to_bytes, ... is refused outright: no template pads to
  4 million). Every other result is checked after it is built, before the template can grow it.

The refusals are raised inside the template as `_Refusal`, a BaseException, so that no `except
Exception` (jinja's own, or a filter's `except ValueError`) swallows one, and become a
ChatTemplateLimitError at the render's boundary. The tracer stands in for a debugger's or
coverage's (sys.gettrace) while a template renders, and gives it back after. `ChatTemplate` is a
template's text that remembers where it was read from, so every ChatTemplateError names the file.
"""
from __future__ import annotations

import functools
import re
import sys
import time
from collections.abc import Mapping

from jinja2.compiler import CodeGenerator, optimizeconst
from jinja2.runtime import markup_join
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.utils import Namespace, _PassArg

from kvjax.errors import KvjaxError

MAX_TEMPLATE_CHARS = 2**22  # ~1M tokens of prompt: the rendered text and any one value a template builds
MAX_TEMPLATE_SOURCE = 2**18  # a template's own text: published ones are a few KB; this much compiles in ~5 s
MAX_INT_BITS = 2**16  # an integer a template computes (10 ** 20000 is already 66,439 bits)
MAX_TEMPLATE_STEPS = 2_000_000  # Python calls + template lines in one render (~1 s traced)
MAX_TEMPLATE_SECONDS = 10.0
MAX_TEMPLATE_DEPTH = 64  # nested template frames: macros, caller() blocks, recursive loops
TEMPLATE_FILE = "<template>"  # the file name jinja compiles a template from a string under


class ChatTemplateError(KvjaxError):
    """A chat template that cannot render the given messages; the message says why (and names the
    template's source file when it is known)."""


class ChatTemplateLimitError(ChatTemplateError):
    """A chat template that ran past a limit of time, size or depth (module docstring)."""


class ChatTemplate(str):
    """A chat template's text that remembers where it came from: `source` names the file (and the
    field in it), for error messages. It is a str everywhere else."""

    source: str | None

    def __new__(cls, text: str, source: str | None = None):
        self = super().__new__(cls, text)
        self.source = source
        return self


def where(template) -> str:
    """' from SOURCE' for a ChatTemplate that knows its file, '' otherwise (for messages)."""
    source = getattr(template, "source", None)
    return f" from {source}" if source else ""


class _Refusal(BaseException):
    """A limit hit inside a render (module docstring: why a BaseException)."""


def _refuse(message: str):
    raise _Refusal(message)


# --------------------------------------------------------------------------------------------
# Sizes
# --------------------------------------------------------------------------------------------
def _check_size(n: int, what: str) -> None:
    if n > MAX_TEMPLATE_CHARS:
        _refuse(f"{what} would be {n:,} characters or items, more than the limit {MAX_TEMPLATE_CHARS:,}")


def _check_result(value, what: str):
    """A value a template built: its size within the limits (a str, list, dict, int, ...)."""
    if isinstance(value, bool):
        return value
    if isinstance(value, int):
        if value.bit_length() > MAX_INT_BITS:
            _refuse(f"{what} gave an integer of {value.bit_length():,} bits, more than the limit {MAX_INT_BITS:,}")
    elif hasattr(value, "__len__") and not isinstance(value, range):  # a range is lazy (and jinja caps it)
        _check_size(len(value), what)
    return value


_ESCAPED = re.compile(r"[^\x20-\x7e]|[\"'\\]")  # what repr or json.dumps may spell with more than itself


def _text_bound(value, indent: int = 0) -> int:
    """An upper bound on the length of str(value), repr(value) and json.dumps(value) (with this
    indent), walked iteratively and stopped once it passes the limit (so a cycle ends too). A
    string inside a container counts its plain ASCII characters once and each other character
    12 times: json's "\\ud83d\\ude00" is one."""
    if isinstance(value, str):
        return len(value)
    total, stack = 0, [(value, 1)]
    while stack and total <= MAX_TEMPLATE_CHARS:
        v, depth = stack.pop()
        if isinstance(v, str):
            plain = len(_ESCAPED.sub("", v))
            total += plain + 12 * (len(v) - plain) + 3
        elif isinstance(v, bytes):
            total += 4 * len(v) + 3
        elif isinstance(v, bool) or v is None:
            total += 5
        elif isinstance(v, int):
            total += v.bit_length() // 3 + 2
        elif isinstance(v, (list, tuple, set, frozenset)):
            total += 3 + indent * depth + len(v) * (3 + indent * depth)  # brackets, and a line an item
            stack.extend((x, depth + 1) for x in v)
        elif isinstance(v, Mapping):
            total += 3 + indent * depth + len(v) * (5 + indent * depth)
            stack.extend((x, depth + 1) for kv in v.items() for x in kv)
        elif isinstance(v, Namespace):
            total += 16
            stack.append((v._Namespace__attrs, depth))  # its repr shows its attributes
        else:
            total += 64  # a float, an undefined, a loop or macro object: a short repr
    return total


def _check_text(value, what: str, indent: int = 0) -> None:
    if not isinstance(value, str):
        _check_size(_text_bound(value, indent), f"the text of {what}")


_WIDTHS = {"%": re.compile(r"%(?:\([^)]*\))?[#0 +-]*(\d*)(?:\.(\d*))?"),  # %(key)-10.5s
           "{}": re.compile(r"\{[^{}]*?:[^{}\d]*(\d*)(?:\.(\d*))?")}  # {0:>10.5}


def _check_format(fmt: str, args, kind: str, what: str) -> None:
    """A %-format or str.format string: no literal width or precision above the limit, and the
    text of its arguments within it (a nested "{:{}}" width comes from an integer argument, which
    the caller checks)."""
    for match in _WIDTHS[kind].finditer(fmt):
        for digits in match.groups():
            if digits and len(digits) > 7 and int(digits) > MAX_TEMPLATE_CHARS:
                _refuse(f"{what} pads to {int(digits):,} characters, more than the limit {MAX_TEMPLATE_CHARS:,}")
    _check_size(len(fmt) + sum(_text_bound(a) for a in args), what)


def _check_ints(args, kwargs, what: str) -> None:
    for a in (*args, *kwargs.values()):
        if isinstance(a, int) and not isinstance(a, bool) and abs(a) > MAX_TEMPLATE_CHARS:
            _refuse(f"{what} was given {a:,}, above the limit {MAX_TEMPLATE_CHARS:,} on widths and counts")


def _check_percent(fmt: str, right, what: str) -> None:
    """`fmt % right`: its literal widths, a "*" width's integer argument, and its arguments' text."""
    values = tuple(right) if isinstance(right, tuple) else tuple(right.values()) if isinstance(right, Mapping) \
        else (right,)
    if "*" in fmt:
        _check_ints(values, {}, what)
    _check_format(fmt, values, "%", what)


def _replace_bound(s, old, new, count=-1) -> int:
    n = len(s) + 1 if not old else s.count(old)
    n = n if count is None or count < 0 else min(n, count)
    return len(s) + n * max(0, len(new) - len(old))


def _join_bound(sep, items) -> int:
    return sum(_text_bound(x) for x in items) + len(sep) * max(0, len(items) - 1)


# --------------------------------------------------------------------------------------------
# Filters and methods that multiply sizes: checked before they run
# --------------------------------------------------------------------------------------------
# filters whose result is the text of their value (a container's text is bounded first)
_TEXT_FILTERS = {"string", "pprint", "e", "escape", "forceescape", "urlize", "title", "capitalize", "upper",
                 "lower", "trim", "striptags", "center", "indent", "wordwrap", "truncate", "replace", "format",
                 "wordcount", "safe", "urlencode", "xmlattr", "join"}


# filters whose integer arguments are widths or counts of what they build
_WIDTH_FILTERS = {"center", "indent", "wordwrap", "truncate", "batch", "slice", "tojson"}


def _filter_args(name: str, value, args: tuple, kwargs: dict):
    """Checks a filter's arguments before it runs; returns (value, args), value made a list when
    the check had to read an iterator."""
    what = f"the {name} filter"
    if name in _WIDTH_FILTERS:
        _check_ints(args, kwargs, what)
    if name in _TEXT_FILTERS and name != "join":
        _check_text(value, what)
    text = str(value) if isinstance(value, str) else ""
    if name == "indent":
        width = kwargs.get("width", args[0] if args else 4)
        width = len(width) if isinstance(width, str) else width if isinstance(width, int) else 0
        _check_size(len(text) + (text.count("\n") + 1) * width, what)
    elif name == "wordwrap":
        width = kwargs.get("width", args[0] if args else 79)
        wrap = kwargs.get("wrapstring", args[2] if len(args) > 2 else None) or "\n"
        if isinstance(width, int) and width > 0 and isinstance(wrap, str):
            _check_size(len(text) + (len(text) // width + 1) * len(wrap), what)
    elif name == "replace" and len(args) >= 2 and all(isinstance(a, str) for a in args[:2]):
        count = args[2] if len(args) > 2 else kwargs.get("count")
        _check_size(_replace_bound(text, args[0], args[1], count if isinstance(count, int) else -1), what)
    elif name == "format":
        _check_percent(text, kwargs or args, what)
    elif name == "join":
        value = list(value) if not isinstance(value, (list, tuple)) else value
        sep = kwargs.get("d", args[0] if args else "")
        _check_size(_join_bound(sep if isinstance(sep, str) else "", value), what)
    elif name == "tojson":
        indent = kwargs.get("indent", args[1] if len(args) > 1 else None)
        indent = len(indent) if isinstance(indent, str) else indent if isinstance(indent, int) else 0
        _check_text(value if not isinstance(value, str) else [value], what, indent)
    elif name == "sum":
        start = kwargs.get("start", args[1] if len(args) > 1 else 0)
        if not isinstance(start, (int, float)):  # sum(lists, start=[]) is quadratic in C
            _refuse(f"{what} adds numbers only, got a start of {type(start).__name__}")
    return value, args


def _bounded_filter(name: str, f):
    """`f` with its arguments checked first and its result after (keeps jinja's pass_* marker)."""
    skip = 0 if _PassArg.from_obj(f) is None else 1  # the context / eval context / environment it is passed

    @functools.wraps(f)
    def bounded(*args, **kwargs):
        value, rest = _filter_args(name, args[skip], args[skip + 1:], kwargs)
        return _check_result(f(*args[:skip], value, *rest, **kwargs), f"the {name} filter")

    return bounded


# built-in values' methods whose integer arguments are widths or counts of what they build
_WIDTH_METHODS = {"center", "ljust", "rjust", "zfill", "expandtabs", "to_bytes"}
_NESTED_WIDTH = re.compile(r"\{[^{}]*:[^{}]*\{")  # "{:{}}": a width taken from an argument


def _check_method(method, args: tuple, kwargs: dict) -> tuple:
    """A call of a built-in value's method (str.ljust, int.to_bytes, ...): no width or count above
    the limit, and the str/bytes methods whose result multiplies sizes bounded first. Returns
    args (join's iterator made a list)."""
    bound = getattr(method, "__wrapped__", method)  # the sandbox wraps str.format in a function of its own
    owner, name = getattr(bound, "__self__", None), getattr(bound, "__name__", "")
    if not isinstance(owner, (str, bytes, int)) or isinstance(owner, bool):
        return args
    what = f"{type(owner).__name__}.{name}()"
    if name in _WIDTH_METHODS or (name in ("format", "format_map") and _NESTED_WIDTH.search(owner)):
        _check_ints((*args, *(args[0].values() if name == "format_map" and args and isinstance(args[0], Mapping)
                               else ())), kwargs, what)
    if not isinstance(owner, (str, bytes)):
        return args
    if name == "replace" and len(args) >= 2 and all(isinstance(a, type(owner)) for a in args[:2]):
        _check_size(_replace_bound(owner, args[0], args[1], args[2] if len(args) > 2 else -1), what)
    elif name == "join" and args:
        args = (list(args[0]), *args[1:])
        _check_size(_join_bound(owner, args[0]), what)
    elif name == "expandtabs":
        tab = args[0] if args else kwargs.get("tabsize", 8)
        _check_size(len(owner) + owner.count("\t" if isinstance(owner, str) else b"\t") * max(tab, 0), what)
    elif name == "translate" and args and isinstance(args[0], Mapping):
        longest = max((len(v) for v in args[0].values() if isinstance(v, (str, bytes))), default=1)
        _check_size(len(owner) * max(longest, 1), what)
    elif name in ("format", "format_map"):
        _check_format(owner, (*args, *kwargs.values(), *(args[0].values() if name == "format_map" and args
                                                          and isinstance(args[0], Mapping) else ())), "{}", what)
    return args


# --------------------------------------------------------------------------------------------
# The environment
# --------------------------------------------------------------------------------------------
class _BoundedCodeGenerator(CodeGenerator):
    """Jinja's code generator with `a ~ b` compiled to environment.join_bounded (checked first)."""

    @optimizeconst
    def visit_Concat(self, node, frame) -> None:
        markup = ("context.eval_ctx.volatile" if frame.eval_ctx.volatile else
                  "True" if frame.eval_ctx.autoescape else "False")
        self.write("environment.join_bounded((")
        for arg in node.nodes:
            self.visit(arg, frame)
            self.write(", ")
        self.write(f"), {markup})")


class _Filters(dict):
    """The environment's filters, each wrapped by _bounded_filter, also those added later."""

    def __init__(self, filters):
        super().__init__()
        for name, f in filters.items():
            self[name] = f

    def __setitem__(self, name: str, f) -> None:
        super().__setitem__(name, _bounded_filter(name, f))


def _bounded_lipsum(lipsum):
    """jinja's lipsum(n, html, min, max) global: at most MAX_TEMPLATE_CHARS of text (~12 a word)."""
    def bounded(n=5, html=True, min=20, max=100):  # noqa: A002  (jinja's names)
        if isinstance(n, int) and isinstance(max, int) and n * max * 12 > MAX_TEMPLATE_CHARS:
            _refuse(f"lipsum({n:,}, max={max:,}) would pass the limit of {MAX_TEMPLATE_CHARS:,} characters")
        return lipsum(n, html, min, max)

    return bounded


class BoundedSandbox(ImmutableSandboxedEnvironment):
    """transformers' ImmutableSandboxedEnvironment with the limits of the module docstring: the
    size checks live here (operators, calls, filters, output joins); the work and depth limits
    in `render`."""

    code_generator_class = _BoundedCodeGenerator
    intercepted_binops = frozenset({"*", "**", "%", "+"})

    def __init__(self, **kwargs):
        super().__init__(finalize=self._finalize, **kwargs)
        self.filters = _Filters(self.filters)
        self.globals["lipsum"] = _bounded_lipsum(self.globals["lipsum"])

    @staticmethod
    def _finalize(value):
        _check_text(value, "an output {{ ... }}")  # before str() turns a container into its text
        return value

    def concat(self, pieces) -> str:  # a macro's, a block's, a {% set %} block's output
        pieces = list(pieces)
        _check_size(sum(len(p) for p in pieces), "the output of a block or macro")
        return "".join(pieces)

    def join_bounded(self, args: tuple, markup) -> str:
        _check_size(sum(_text_bound(a) for a in args), "a ~ concatenation")
        return markup_join(args) if markup else "".join(map(str, args))

    def call_binop(self, context, operator: str, left, right):
        what = f"a {operator} operation"
        ints = isinstance(left, int) and isinstance(right, int)
        if operator == "*":
            if ints:
                if left.bit_length() + right.bit_length() > MAX_INT_BITS:
                    _refuse(f"{what} on integers of {left.bit_length():,} and {right.bit_length():,} bits would "
                            f"pass the limit of {MAX_INT_BITS:,} bits")
            elif isinstance(right, int) and hasattr(left, "__len__"):
                _check_size(len(left) * max(right, 0), what)
            elif isinstance(left, int) and hasattr(right, "__len__"):
                _check_size(len(right) * max(left, 0), what)
        elif operator == "**" and ints and right > 0 and abs(left) > 1:
            if right * left.bit_length() > MAX_INT_BITS:
                _refuse(f"{what} would give an integer of about {right * left.bit_length():,} bits, more than "
                        f"the limit {MAX_INT_BITS:,}")
        elif operator == "+" and hasattr(left, "__len__") and hasattr(right, "__len__"):
            _check_size(len(left) + len(right), what)
        elif operator == "%" and isinstance(left, str):
            _check_percent(left, right, what)
        return _check_result(super().call_binop(context, operator, left, right), what)

    def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805  (jinja's signature)
        args = _check_method(__obj, args, kwargs)
        return _check_result(super().call(__context, __obj, *args, **kwargs),
                             f"calling {getattr(__obj, '__name__', type(__obj).__name__)}")


# --------------------------------------------------------------------------------------------
# Rendering within the work and depth limits
# --------------------------------------------------------------------------------------------
class _Budget:
    """The tracer of one render: counts steps (Python calls, template lines) and template-frame
    depth, and refuses past the limits. Only template frames are traced line by line."""

    def __init__(self):
        self.steps, self.depth = 0, 0
        self.deadline = time.monotonic() + MAX_TEMPLATE_SECONDS

    def step(self) -> None:
        self.steps += 1
        if self.steps > MAX_TEMPLATE_STEPS:
            _refuse(f"it ran more than {MAX_TEMPLATE_STEPS:,} steps (calls and template lines); a chat template "
                    "takes under a hundred a message")
        if not self.steps & 1023 and time.monotonic() > self.deadline:
            _refuse(f"it ran longer than {MAX_TEMPLATE_SECONDS:g} s")

    def __call__(self, frame, event, arg):  # the global tracer: a 'call' event of any frame
        self.step()
        if frame.f_code.co_filename != TEMPLATE_FILE:
            return None
        self.depth += 1
        if self.depth > MAX_TEMPLATE_DEPTH:
            _refuse(f"its macros or recursive loops nest deeper than {MAX_TEMPLATE_DEPTH}")
        return self.local

    def local(self, frame, event, arg):  # a template frame's own events
        if event == "line":
            self.step()
        elif event == "return":  # also each yield of a generator, whose resumption is a 'call'
            self.depth -= 1
        return self.local


def render(compiled, template, variables: dict) -> str:
    """compiled.generate(**variables) joined, within the limits of the module docstring; a limit
    hit is a ChatTemplateLimitError naming `template`'s source."""
    budget, previous = _Budget(), sys.gettrace()
    pieces, size = [], 0
    sys.settrace(budget)
    try:
        for piece in compiled.generate(**variables):
            size += len(piece)
            _check_size(size, "the rendered prompt")
            pieces.append(piece)
    except _Refusal as e:
        raise ChatTemplateLimitError(f"the chat template{where(template)} was stopped: {e}") from None
    except RecursionError:
        raise ChatTemplateLimitError(f"the chat template{where(template)} was stopped: it recursed past "
                                     "Python's stack limit") from None
    except MemoryError:
        raise ChatTemplateLimitError(f"the chat template{where(template)} was stopped: it ran out of "
                                     "memory") from None
    finally:
        sys.settrace(previous)
    return "".join(pieces)


def compile_template(env: BoundedSandbox, template: str):
    """env.from_string(template), its size and nesting bounded; a _Refusal (a filter folded at
    compile time past a limit) or a parser RecursionError a ChatTemplateLimitError."""
    if len(template) > MAX_TEMPLATE_SOURCE:
        raise ChatTemplateLimitError(f"the chat template{where(template)} is {len(template):,} characters, more "
                                     f"than the limit {MAX_TEMPLATE_SOURCE:,}")
    try:
        return env.from_string(template)
    except _Refusal as e:
        raise ChatTemplateLimitError(f"the chat template{where(template)} was stopped: {e}") from None
    except RecursionError:
        raise ChatTemplateLimitError(f"the chat template{where(template)} nests too deeply to "
                                     "parse") from None
