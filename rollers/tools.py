"""Tools for the agent loop: plain Python functions with a JSON schema, the tool-call format, and a calculator.

A :class:`Tool` is a function plus the JSON schema of its arguments (the ``parameters`` object of the
OpenAI / Hermes function-calling convention). ``@tool(schema)`` turns a function into one; the function may
be sync (run in a thread of its own) or async. Arguments are validated against the schema (``jsonschema``)
before the call.

Tool-call format (what the model writes; Hermes / Qwen2.5 function calling, which SmolLM2 and Qwen
chat models are prompted with)::

    <tool_call>{"name": "calculator", "arguments": {"expression": "12 + 30"}}</tool_call>

``parse_tool_call(text)`` returns the first call in ``text`` or ``None`` when there is none;
a malformed call (bad JSON, no name) is returned as a :class:`ToolCall` with ``error`` set, so the
environment can tell the model what was wrong instead of ending the trajectory.

``call_tool(tools, call, timeout_s)`` runs one parsed call on the tool it names: an unknown tool or a bad
argument is an *answer* to the model (the text of the error), while a tool that raises or runs past
``timeout_s`` raises :class:`ToolError`, which fails the trajectory (``rollers.agent_loop``), never the
roller. A sync tool runs in a thread of its own (``rollers.user_calls``): one that blocks forever holds
only its own thread, and later calls still run.
"""

from __future__ import annotations

import ast
import inspect
import json
import operator
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jsonschema

from rollers.user_calls import call_user

_TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)


class ToolError(RuntimeError):
    """A tool raised or timed out: the trajectory that called it fails (counted), the roller goes on."""


@dataclass(frozen=True)
class Tool:
    """A tool: ``fn(**arguments)`` (sync or async) returning something ``str()`` can show the model;
    ``parameters``: the JSON schema of the arguments (an ``object`` schema); ``description``: for prompts."""

    name: str
    fn: Callable[..., Any]
    parameters: dict
    description: str = ""

    def __post_init__(self):
        if not self.name or not isinstance(self.parameters, dict) or self.parameters.get("type") != "object":
            raise ValueError(f"tool {self.name!r}: needs a name and an 'object' JSON schema, got {self.parameters!r}")
        jsonschema.Draft202012Validator.check_schema(self.parameters)

    def spec(self) -> dict:
        """The OpenAI-style function spec ``{"type": "function", "function": {name, description, parameters}}``
        (what a chat template's ``tools=`` argument takes)."""
        return {"type": "function",
                "function": {"name": self.name, "description": self.description, "parameters": self.parameters}}


def tool(parameters: dict, *, name: str | None = None, description: str | None = None) -> Callable[[Callable], Tool]:
    """Decorator: the function becomes a :class:`Tool` named ``name`` (default the function's name) with the
    argument schema ``parameters`` and ``description`` (default the docstring's first line)."""

    def wrap(fn: Callable) -> Tool:
        doc = (inspect.getdoc(fn) or "").split("\n")[0]
        return Tool(name or fn.__name__, fn, parameters, doc if description is None else description)

    return wrap


@dataclass(frozen=True)
class ToolCall:
    """A parsed call: ``name`` and ``arguments``; ``error`` says why the call text could not be read."""

    name: str
    arguments: dict
    error: str = ""


def parse_tool_call(text: str) -> ToolCall | None:
    """The first ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` in ``text`` (an unclosed tag
    runs to the end), ``None`` when ``text`` has no ``<tool_call>`` tag. A tag whose content is not a JSON
    object with a string ``name`` and an object ``arguments`` gives a ToolCall with ``error`` set."""
    match = _TOOL_CALL.search(text)
    if match is None:
        return None
    try:
        call = json.loads(match.group(1))
    except json.JSONDecodeError as exc:
        return ToolCall("", {}, f"the tool call is not valid JSON: {exc.msg}")
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return ToolCall("", {}, 'a tool call must be {"name": ..., "arguments": {...}}')
    arguments = call.get("arguments", {})
    if not isinstance(arguments, dict):
        return ToolCall(call["name"], {}, "the tool call's arguments must be a JSON object")
    return ToolCall(call["name"], arguments)


async def call_tool(tools: dict[str, Tool], call: ToolCall, timeout_s: float) -> str:
    """Run ``call`` on one of ``tools`` (by name) and return the text shown to the model.

    An unreadable call, an unknown tool or arguments that fail the schema give an error text (the model's
    mistake, answered). A tool that raises or runs past ``timeout_s`` seconds raises :class:`ToolError`.
    """
    if call.error:
        return f"error: {call.error}"
    if call.name not in tools:
        return f"error: unknown tool {call.name!r}; tools: {sorted(tools)}"
    target = tools[call.name]
    try:
        jsonschema.validate(call.arguments, target.parameters)
    except jsonschema.ValidationError as exc:
        return f"error: bad arguments for {call.name}: {exc.message}"
    try:
        result = await call_user(timeout_s, target.fn, **call.arguments)
    except TimeoutError as exc:
        raise ToolError(f"tool {call.name!r} took longer than {timeout_s} s") from exc
    except Exception as exc:  # a tool may fail in any way: its trajectory fails, not the roller
        raise ToolError(f"tool {call.name!r} raised {type(exc).__name__}: {exc}") from exc
    return str(result)


# ------------------------------------------------------------------------------------------ calculator

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.USub: operator.neg,
        ast.UAdd: operator.pos}
_MAX_DIGITS = 64


def _evaluate(node: ast.AST) -> int:
    if isinstance(node, ast.Expression):
        return _evaluate(node.body)
    if isinstance(node, ast.Constant) and isinstance(node.value, int) and not isinstance(node.value, bool):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        value = _OPS[type(node.op)](_evaluate(node.left), _evaluate(node.right))
        if len(str(abs(value))) > _MAX_DIGITS:
            raise ValueError(f"result has more than {_MAX_DIGITS} digits")
        return value
    if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_evaluate(node.operand))
    raise ValueError("only integers, +, -, * and parentheses are allowed")


def evaluate_expression(expression: str) -> str:
    """The value of an integer expression with ``+ - *`` and parentheses (no names, no calls: parsed with
    ``ast`` and walked, never ``eval``), or ``error: ...`` for anything else. Never raises."""
    if len(expression) > 512:
        return "error: expression longer than 512 characters"
    try:
        return str(_evaluate(ast.parse(expression.strip(), mode="eval")))
    except (SyntaxError, ValueError, RecursionError) as exc:
        return f"error: {exc}"


calculator = Tool(
    "calculator", evaluate_expression,
    {"type": "object", "properties": {"expression": {"type": "string", "description": "e.g. 123 + 45 - 6"}},
     "required": ["expression"], "additionalProperties": False},
    "Evaluate an integer arithmetic expression with +, - and *.",
)
