"""``bench agent --client``'s pieces that need no CLI: the configuration it
writes for each one, and how it reads a turn back from the recorded
answers (each protocol's usage, the turn's own request among its side
requests)."""

from __future__ import annotations

import json
import tomllib
from pathlib import Path

from bench.scenarios import _real_clients as real

URL = "http://127.0.0.1:9"


def test_codex_gets_a_responses_provider_with_no_key(tmp_path: Path) -> None:
    env = real.client_env("codex", tmp_path, URL, 32)
    config = tomllib.loads((Path(env["CODEX_HOME"]) / "config.toml").read_text())
    provider = config["model_providers"][config["model_provider"]]
    assert provider["base_url"] == f"{URL}/v1"
    assert provider["wire_api"] == "responses"
    assert "env_key" not in provider
    assert config["check_for_update_on_startup"] is False
    # Codex's default features: its sub-agent tools come as a namespace tool.
    assert "multi_agent" not in config.get("features", {})


def test_opencode_gets_an_openai_compatible_provider(tmp_path: Path) -> None:
    env = real.client_env("opencode", tmp_path, URL, 32)
    path = Path(env["XDG_CONFIG_HOME"]) / "opencode" / "opencode.json"
    provider = json.loads(path.read_text())["provider"]["gezel"]
    assert provider["npm"] == "@ai-sdk/openai-compatible"
    assert provider["options"]["baseURL"] == f"{URL}/v1"
    assert env["OPENCODE_DISABLE_MODELS_FETCH"] == "1"


def test_claude_code_points_at_the_server_with_its_traffic_off(tmp_path: Path) -> None:
    env = real.client_env("claude-code", tmp_path, URL, 32)
    assert env["ANTHROPIC_BASE_URL"] == URL
    assert env["CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC"] == "1"
    assert env["CLAUDE_CODE_MAX_OUTPUT_TOKENS"] == "32"
    assert "ANTHROPIC_API_KEY" not in env


def test_later_turns_continue_the_session() -> None:
    bin_dir = Path("/bin")
    assert "--continue" in real.client_command("claude-code", bin_dir, 2, "hi")
    assert real.client_command("codex", bin_dir, 2, "hi")[1:4] == ["exec", "resume", "--last"]
    assert "--continue" in real.client_command("opencode", bin_dir, 2, "hi")
    assert "--continue" not in real.client_command("opencode", bin_dir, 1, "hi")


def _event(body: object) -> str:
    return "data: " + json.dumps(body)


def test_usage_in_each_protocol() -> None:
    messages = {
        "response_events": [
            _event({"type": "message_start", "message": {"usage": {"input_tokens": 900}}}),
            _event(
                {
                    "type": "message_delta",
                    "usage": {
                        "input_tokens": 8,
                        "cache_read_input_tokens": 880,
                        "cache_creation_input_tokens": 12,
                    },
                }
            ),
        ]
    }
    chat = {
        "response_events": [
            _event({"usage": {"prompt_tokens": 500, "prompt_tokens_details": {"cached": 1}}}),
            _event(
                {"usage": {"prompt_tokens": 500, "prompt_tokens_details": {"cached_tokens": 448}}}
            ),
        ]
    }
    responses = {
        "response_events": [
            _event(
                {
                    "type": "response.completed",
                    "response": {
                        "usage": {
                            "input_tokens": 700,
                            "input_tokens_details": {"cached_tokens": 640},
                        }
                    },
                }
            )
        ]
    }
    assert real.usage_of(messages) == (900, 880)
    assert real.usage_of(chat) == (500, 448)
    assert real.usage_of(responses) == (700, 640)


def test_a_turn_is_its_own_request_not_its_title_or_retries() -> None:
    def record(tools: int, prompt: int, status: int = 200) -> dict[str, object]:
        usage = {"prompt_tokens": prompt, "prompt_tokens_details": {"cached_tokens": 0}}
        return {
            "body": {"tools": [{}] * tools},
            "status": status,
            "response": {"usage": usage},
            "timing": {"first_delta_s": prompt / 100},
        }

    title, turn, retry = record(0, 950), record(10, 12_500), record(10, 12_600)
    got = real._turn(1, [title, turn, retry], 3.0, exit_code=0)
    assert (got.requests, got.prompt, got.ttft_s, got.completed) == (3, 12_500, 125.0, True)
    failed = real._turn(2, [record(10, 100, status=400)], 1.0, exit_code=0)
    assert not failed.completed
