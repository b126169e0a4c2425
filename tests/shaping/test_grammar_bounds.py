"""The grammar bounds: what each measures, where each refuses, and that a
grammar at every limit compiles on a small stack.

Only the last test runs llguidance, and in a subprocess: a bound that let
too deep a grammar through would crash that process, not pytest.
"""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gezel_trio.core.errors import InvalidRequest
from gezel_trio.shaping.grammar import build_constraint, custom_grammar_problem
from gezel_trio.shaping.grammar_bounds import (
    MAX_LARK_ALTERNATIVES,
    MAX_LARK_DEPTH,
    MAX_LARK_NESTING,
    MAX_LARK_RULES,
    MAX_REGEX_NESTING,
    MAX_SCHEMA_REF_DEPTH,
    lark_problem,
    regex_problem,
    schema_problem,
)
from tests.support.fuzzing import (
    many_alternatives,
    nested_groups,
    nested_parens,
    nested_schema,
    ref_chain,
    rule_chain,
    terminal_chain,
)


def test_a_rule_chain_at_the_depth_limit_passes_and_one_more_is_refused() -> None:
    # start, r0 .. rn: n + 2 rules on the one path.
    assert lark_problem(rule_chain(MAX_LARK_DEPTH - 2)) is None
    problem = lark_problem(rule_chain(MAX_LARK_DEPTH - 1))
    assert problem is not None
    assert f"{MAX_LARK_DEPTH} deep" in problem


def test_terminals_count_as_rules_and_references() -> None:
    assert lark_problem(terminal_chain(MAX_LARK_DEPTH - 2)) is None
    assert "deep" in (lark_problem(terminal_chain(MAX_LARK_DEPTH - 1)) or "")
    flat = "\n".join(["start: " + " ".join(f"T{i}" for i in range(MAX_LARK_RULES))])
    flat += "".join(f'\nT{i}: "a"' for i in range(MAX_LARK_RULES))
    assert f"{MAX_LARK_RULES} rules" in (lark_problem(flat) or "")


def test_nesting_and_alternatives_are_counted_outside_strings_regexes_and_comments() -> None:
    assert lark_problem(nested_parens(MAX_LARK_NESTING)) is None
    assert "nest" in (lark_problem(nested_parens(MAX_LARK_NESTING + 1)) or "")
    assert lark_problem(many_alternatives(MAX_LARK_ALTERNATIVES + 1)) is None  # n items, n-1 bars
    assert "alternatives" in (lark_problem(many_alternatives(MAX_LARK_ALTERNATIVES + 2)) or "")
    quoted = 'start: "((((|" /[(|]\\(/ // ((((((|\n'
    assert lark_problem(quoted * 1) is None
    assert lark_problem("start: " + " ".join(['"|("'] * 5_000)) is None


def test_a_recursive_grammar_is_not_a_deep_one() -> None:
    expr = 'start: expr\nexpr: term | expr "+" term\nterm: "x" | "(" expr ")"\n'
    assert lark_problem(expr) is None


def test_regex_groups_are_counted_outside_classes_and_escapes() -> None:
    assert regex_problem(nested_groups(MAX_REGEX_NESTING)) is None
    assert regex_problem(nested_groups(MAX_REGEX_NESTING + 1)) is not None
    assert regex_problem("[(]" * 500 + r"\(" * 500 + "[](]" * 500) is None
    assert lark_problem(f"start: /{nested_groups(MAX_REGEX_NESTING + 1)}/") is not None


def test_a_ref_chain_is_as_deep_as_its_links() -> None:
    # Three levels a link (the definition, its properties, the property).
    assert schema_problem(ref_chain(MAX_SCHEMA_REF_DEPTH // 3 - 2)) is None
    problem = schema_problem(ref_chain(MAX_SCHEMA_REF_DEPTH // 3 + 1))
    assert problem is not None
    assert f"{MAX_SCHEMA_REF_DEPTH} levels" in problem
    # Byte size is no guide: the same links, named apart, are as deep.
    assert schema_problem(nested_schema(MAX_SCHEMA_REF_DEPTH)) is not None


def test_recursive_and_unresolved_refs_add_nothing() -> None:
    tree = {
        "$defs": {
            "node": {
                "type": "object",
                "properties": {"kids": {"type": "array", "items": {"$ref": "#/$defs/node"}}},
            }
        },
        "$ref": "#/$defs/node",
    }
    assert schema_problem(tree) is None
    loose = {"properties": {"a": {"$ref": "#/$defs/none"}, "b": {"$ref": "http://x/y"}}}
    assert schema_problem(loose) is None


def test_a_json_directive_in_lark_is_held_to_the_schema_bound() -> None:
    deep = "start: %json " + json.dumps(ref_chain(200))
    assert "%json schema" in (lark_problem(deep) or "")
    assert "not followed by a JSON schema" in (lark_problem("start: %json {") or "")


def test_build_constraint_refuses_before_compiling() -> None:
    schema = ref_chain(1_000)
    with pytest.raises(InvalidRequest) as info:
        build_constraint(
            response_format={"type": "json_schema", "json_schema": {"name": "s", "schema": schema}},
            tools=None,
            tool_choice=None,
            tool_grammar=None,
        )
    assert info.value.param == "response_format"
    assert "response_format.json_schema.schema" in str(info.value)
    assert custom_grammar_problem("lark", rule_chain(3_000)) is not None
    assert custom_grammar_problem("regex", nested_groups(900)) is not None


_ANY_TEXT = st.text(alphabet=st.sampled_from(list('ab:|()[]/"\\%{}\n #?!.T_0')), max_size=400)


@settings(max_examples=300, deadline=None, database=None)
@given(text=_ANY_TEXT)
def test_any_text_is_measured_without_an_error(text: str) -> None:
    assert lark_problem(text) is None or isinstance(lark_problem(text), str)
    assert regex_problem(text) is None or isinstance(regex_problem(text), str)


_JSON = st.recursive(
    st.one_of(st.none(), st.integers(), st.sampled_from(["#", "#/a", "#/$defs/0", "#/0/1"])),
    lambda inner: st.one_of(
        st.lists(inner, max_size=3),
        st.dictionaries(st.sampled_from(["a", "$ref", "$defs", "0", "1"]), inner, max_size=3),
    ),
    max_leaves=20,
)


@settings(max_examples=300, deadline=None, database=None)
@given(schema=_JSON)
def test_any_json_is_measured_without_an_error(schema: Any) -> None:
    problem = schema_problem(schema)
    assert problem is None or "levels" in problem


_AT_THE_LIMITS = """
import json, sys, threading
import llguidance
from gezel_trio.shaping.grammar import parser_limits
from gezel_trio.shaping.grammar_bounds import lark_problem, schema_problem
cases = json.loads(sys.stdin.read())
def run():
    for kind, text in cases:
        problem = schema_problem(json.loads(text)) if kind == "schema" else lark_problem(text)
        assert problem is None, (kind, problem)
        grammar = (
            llguidance.LLMatcher.grammar_from_json_schema(text)
            if kind == "schema"
            else llguidance.LLMatcher.grammar_from_lark(text)
        )
        llguidance.LLMatcher.validate_grammar_with_warnings(grammar, None, limits=parser_limits())
    print("compiled", len(cases))
threading.stack_size(1024 * 1024)
thread = threading.Thread(target=run)
thread.start()
thread.join()
"""


def test_grammars_at_the_limits_compile_on_a_one_mib_stack() -> None:
    """The margin the limits keep: on an 8 MiB stack llguidance crashed at
    ten times these depths; here each compiles on 1 MiB (twice the rule
    chain overflowed it)."""
    cases = [
        ("lark", rule_chain(MAX_LARK_DEPTH - 2)),
        ("lark", terminal_chain(MAX_LARK_DEPTH - 2)),
        ("lark", "start: %json " + json.dumps(ref_chain(MAX_SCHEMA_REF_DEPTH // 3 - 2))),
        ("schema", json.dumps(ref_chain(MAX_SCHEMA_REF_DEPTH // 3 - 2))),
    ]
    out = subprocess.run(
        [sys.executable, "-c", _AT_THE_LIMITS],
        input=json.dumps(cases),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == f"compiled {len(cases)}"
