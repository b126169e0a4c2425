"""The bench runner's registry, CLI and report writing, without a measurement.

``python -m bench`` is run by hand, not by CI; these tests keep its
declarations importable and consistent (every scenario module declares a
``SCENARIO``, options that share a flag parse alike, ``--quick`` values pass
the scenario's own choices) and check that a ``Result`` becomes JSON and
markdown. Nothing here starts a server or imports MLX.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from bench import _cli, _report, scenarios
from bench._scenario import Context, Option, Plot, Result, Scenario, Series, table

ROOT = Path(__file__).resolve().parents[2]


def test_registry_finds_every_scenario_module() -> None:
    registry = scenarios.load()
    modules = {p.stem for p in (ROOT / "bench" / "scenarios").glob("[!_]*.py")}
    assert set(registry) == modules
    assert {
        "decode", "agent", "scheduler", "grammar", "cache_blocks", "toolcall_parsing", "fuzz",
        "soak",
    } <= set(registry)  # fmt: skip
    for s in registry.values():
        assert s.summary, s.name
        assert len(s.doc.splitlines()) > 5, f"{s.name}: the docstring says what it measures"


def test_the_long_runs_are_not_in_the_default_run() -> None:
    registry = scenarios.load()
    assert not registry["soak"].in_default_run
    assert not registry["fuzz"].in_default_run
    assert registry["toolcall_parsing"].in_default_run
    # --quick keeps them short: a smoke run, not the real thing.
    assert registry["soak"].resolve({}, quick=True)["minutes"] <= 1
    assert registry["fuzz"].resolve({}, quick=True)["examples"] <= 1000


def test_fuzz_names_the_route_of_a_request() -> None:
    from bench.scenarios.fuzz import route_of

    assert route_of("POST", "/v1/chat/completions") == "chat"
    assert route_of("POST", "/chat/completions") == "alias"
    assert route_of("POST", "/v1/cache/warm") == "warm"
    assert route_of("POST", "/v1/responses") == "responses"
    assert route_of("POST", "/v1/responses/resp_x/cancel") == "response"
    assert route_of("DELETE", "/v1/cache/a%2Fb") == "delete"
    assert route_of("POST", "/admin/flush?settle_ms=5") == "flush"
    assert route_of("GET", "/metrics") == "get"
    assert route_of("PATCH", "/v1/chat/completions") == "odd"


def test_shared_options_parse_alike_and_defaults_pass_choices() -> None:
    registry = scenarios.load()
    _cli.shared_options(registry)  # raises on a disagreement
    _cli.parser(registry)
    for s in registry.values():
        for quick in (False, True):
            s.resolve({}, quick)


def test_resolve_prefers_the_cli_then_quick_then_default() -> None:
    o = Option("tokens", 128, "max_tokens", int, quick=32)
    s = Scenario("x", "X.\n", lambda ctx: Result({}), (o,))
    assert s.resolve({}, quick=False) == {"tokens": 128}
    assert s.resolve({}, quick=True) == {"tokens": 32}
    assert s.resolve({"tokens": 7}, quick=True) == {"tokens": 7}
    c = Scenario("y", "Y.\n", lambda ctx: Result({}), (Option("m", "a", "", choices=("a",)),))
    with pytest.raises(ValueError, match="--m 'b' is not one of"):
        c.resolve({"m": "b"}, quick=False)


def test_list_names_every_scenario() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "bench", "--list"],
        capture_output=True,
        text=True,
        check=True,
        cwd=ROOT,
        timeout=60,
    ).stdout
    for name in scenarios.load():
        assert name in out


def test_an_option_no_chosen_scenario_takes_is_refused(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit):
        _cli.main(["cache_blocks", "--mode", "anonymous"])
    assert "applies to none of cache_blocks" in capsys.readouterr().err


def test_a_run_writes_json_and_markdown(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def run(ctx: Context) -> Result:
        assert ctx.args.tokens == 3
        with ctx.phase("only"):
            pass
        return Result(
            {"runs": [1.5, float("nan")]},
            [table("T", "system | tok/s:.1f", [("gezel", 12.345), ("raw", None)], "a table note")],
            [Plot("P", "streams", "tok/s", (Series("gezel", [1, 2], [1.0, 2.0]),))],
            ["a note"],
        )

    fake = Scenario("fake", "A fake.\n\nIt measures nothing.\n", run, (Option("tokens", 3, ""),))
    monkeypatch.setattr(scenarios, "load", lambda: {"fake": fake})
    assert _cli.main(["fake", "--out", str(tmp_path), "--no-plot"]) == 0
    data = json.loads((tmp_path / "fake.json").read_text())
    assert data["options"] == {"tokens": 3}
    assert data["data"] == {"runs": [1.5, None]}
    assert [p["phase"] for p in data["phases"]] == ["only"]
    md = (tmp_path / "fake.md").read_text()
    assert "| gezel | 12.3 |" in md
    assert "| raw | - |" in md
    assert "|---|--:|" in md  # numbers right-aligned
    assert "a table note" in md
    assert "It measures nothing." in md
    assert not (tmp_path / "fake.png").exists()


def test_percentile_is_nearest_rank() -> None:
    assert _report.percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.0
    assert _report.percentile([1.0, 2.0, 3.0, 4.0], 99) == 4.0
    assert _report.percentile([5.0], 1) == 5.0


def test_decode_pairs_each_round_with_raws_beside_it() -> None:
    from bench.scenarios.decode import _paired_tables, median_interval

    assert median_interval([]) is None
    # Under 6 values no pair of order statistics covers 95%: the whole range.
    assert median_interval([3.0, 1.0, 2.0]) == (1.0, 3.0, 0.75)
    # 15 values: the 4th and 12th, 96.5% (the binomial's own figure).
    lo, hi, coverage = median_interval([float(x) for x in range(15, 0, -1)])  # type: ignore[misc]
    assert (lo, hi) == (4.0, 12.0)
    assert coverage == pytest.approx(0.96484375)
    rounds = [
        {"streams": 8, "raw": 100.0, "gezel": 97.0},
        {"streams": 8, "raw": 80.0, "gezel": 80.0},
        {"streams": 8, "raw": 120.0, "gezel": 126.0},
        {"streams": 1, "raw": 50.0, "gezel": 60.0},
    ]
    (got,) = _paired_tables(rounds, [1, 8], ["raw", "gezel"])
    assert [tuple(r[:2]) for r in got.rows] == [("gezel", 1), ("gezel", 8)]
    eight = got.rows[1]
    assert eight[2] == pytest.approx(1.0)  # the median of 0.97, 1.0 and 1.05
    assert eight[4] == "2 of 3"  # at least 0.98
    assert eight[5] == "0.970 1.000 1.050"
    assert _paired_tables(rounds, [8], ["gezel"]) == []  # nothing to pair with


def test_plots_become_one_png(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")  # the bench extra
    plots = [
        Plot("line", "streams", "tok/s", (Series("a", [1, 2], [1.0, None]), Series("b", [1], [2]))),
        Plot("bar", "", "ms", (Series("idle", ["x", "y"], [1.0, 2.0]),), kind="bar"),
    ]
    assert _report.write_png(tmp_path / "p.png", "title", plots)
    assert (tmp_path / "p.png").read_bytes()[:4] == b"\x89PNG"


def test_profile_puts_each_sample_in_the_innermost_named_category() -> None:
    from bench.scenarios.profile import tally

    host = (
        "thread (61): gezel-mlx-host;Thread.run (threading.py:982);"
        "_in_thread (gezel_trio/host/loop.py:727);_Host.step (gezel_trio/host/loop.py:364);"
        "MlxBackend.step (gezel_trio/mlx/backend.py:965);"
        "GenerationBatch._step (mlx_lm/generate.py:1434)"
    )
    graph = host + ";Model.__call__ (mlx_lm/models/llama.py:215)"
    exchange = (
        "thread (61): gezel-mlx-host;_in_thread (gezel_trio/host/loop.py:727);"
        "from_thread_run_sync (trio/_threads.py:590);"
        "_send_message_to_trio (trio/_threads.py:528)"
    )
    idle = (
        "thread (56): MainThread;run (trio/_core/_run.py:2535);"
        "EpollIOManager.get_events (trio/_core/_io_epoll.py:243)"
    )
    write = (
        "thread (56): MainThread;HTTPStream.app_send (hypercorn/protocol/http_stream.py:196);"
        "SocketStream.send_all (trio/_highlevel_socket.py:120)"
    )
    raw = "\n".join(
        [
            f"{host} 7",
            f"{graph} 2",
            f"{exchange} 3",
            f"{idle} 5",
            f"{write} 1",
            "thread (9): other 4",
        ]
    )
    got = tally(raw)
    assert got["host"] == {
        "waiting for MLX (the step computing)": 7,
        "building the model graph": 2,
        "exchange with the Trio thread": 3,
    }
    assert got["trio"] == {"idle (epoll)": 5, "socket write": 1}


def counting_session(start: int, requests: Any) -> Any:
    """A ``bench._worker.Session`` target: answers each request with a running count."""
    total = start
    for req in requests:
        if req.get("fail"):
            raise ValueError("asked to fail")
        total += req["add"]
        yield {"total": total}


def test_a_worker_session_answers_each_request_in_turn_and_reports_its_death() -> None:
    from bench import _worker

    target = f"{__name__}:counting_session"
    with _worker.Session(target, start=10) as session:
        assert session.ask({"add": 1}) == {"total": 11}
        assert session.ask({"add": 5}) == {"total": 16}  # the same child: its state kept
        with pytest.raises(RuntimeError, match="asked to fail"):
            session.ask({"fail": True})
