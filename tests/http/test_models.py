"""``/v1/models`` and ``/v1/models/{id}`` through the OpenAI SDK on the
dense demo model: the context window under the names editors read it
(``max_model_len``: Cline, opencode; ``context_length``)."""

from __future__ import annotations

import httpx2 as httpx
import openai
import pytest

from tests.support.process import Server


@pytest.mark.slow
def test_models_report_the_window_as_max_model_len(dense_server: Server) -> None:
    client = dense_server.client
    (listed,) = client.models.list().data
    window = httpx.post(f"{dense_server.url}/tokenize", json={"prompt": "x"}, timeout=30).json()[
        "max_model_len"
    ]
    assert window > 0
    assert listed.model_extra is not None
    assert listed.model_extra["max_model_len"] == listed.model_extra["context_length"] == window
    one = client.models.retrieve(listed.id)
    assert one.id == listed.id
    assert one.model_extra == listed.model_extra


@pytest.mark.slow
def test_an_unknown_model_id_is_404_naming_it(dense_server: Server) -> None:
    with pytest.raises(openai.NotFoundError, match="no-such-model") as caught:
        dense_server.client.models.retrieve("no-such-model")
    body = caught.value.body
    assert isinstance(body, dict)
    assert body["code"] == "model_not_found"
