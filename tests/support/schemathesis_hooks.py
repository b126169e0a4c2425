"""schemathesis hooks for ``tests/http/test_openapi.py`` (loaded through
``SCHEMATHESIS_HOOKS``): generation stays cheap, as in the hypothesis fuzzer
(``tests/support/fuzzing.py``).

A length field such as ``max_tokens`` is valid up to the context window
(32,768 tokens on the dense demo model), so a schema-valid example could
decode for minutes and push the run past its timeout by chance. An integer
above 64 is lowered to 64 before sending: still valid (no length field has
a maximum), so negative examples stay invalid for their own reason; that
large values are served is covered elsewhere.
"""

from __future__ import annotations

from typing import Any

import schemathesis

from tests.support.fuzzing import LENGTH_FIELDS

_CAP = 64


@schemathesis.hook
def map_body(context: Any, body: Any) -> Any:
    if isinstance(body, dict):
        for name in LENGTH_FIELDS:
            value = body.get(name)
            if type(value) is int and value > _CAP:
                body[name] = _CAP
    return body
